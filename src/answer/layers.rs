//! The layers of an answer: the caller's names for them (Hugging Face `hidden_states` indices,
//! negative from the end, and `"final_prenorm"`) resolved once into a [`LayerSet`], the one
//! checked list every later step reads (the batch's taps, the answer's columns and labels).

/// The name of the last decoder layer's output before the final norm (Hugging Face's last
/// index is after the norm and it never returns this state); resolved to `num_layers + 1`.
pub const FINAL_PRENORM: &str = "final_prenorm";

/// The layer-index convention, stored in every answer's metadata and in `/v1/info`.
pub const CONVENTION: &str = "hf_hidden_states: index 0 = embedding output, index i = output of decoder layer i \
     (1-based), index L = final output after the last norm; negative indices count from L";

/// A layer as a caller names it: a Hugging Face `hidden_states` index (negative from the end),
/// or `"final_prenorm"`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum LayerRef {
    Index(i64),
    Name(String),
}

impl std::str::FromStr for LayerRef {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().parse::<i64>() {
            Ok(i) => Ok(LayerRef::Index(i)),
            Err(_) if s.trim() == FINAL_PRENORM => Ok(LayerRef::Name(FINAL_PRENORM.into())),
            Err(_) => Err(format!("{s:?} is neither a layer index nor {FINAL_PRENORM:?}")),
        }
    }
}

impl std::fmt::Display for LayerRef {
    /// As the caller wrote it: `17`, `-1` or `"final_prenorm"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerRef::Index(i) => write!(f, "{i}"),
            LayerRef::Name(n) => write!(f, "{n:?}"),
        }
    }
}

/// How a resolved index is written in answers' metadata: the index, or `"final_prenorm"`.
pub fn label(index: usize, num_layers: usize) -> serde_json::Value {
    if index == num_layers + 1 {
        serde_json::Value::from(FINAL_PRENORM)
    } else {
        serde_json::Value::from(index)
    }
}

/// [`label`] as text: `"17"` or `"final_prenorm"` (metric labels, messages).
pub fn name(index: usize, num_layers: usize) -> String {
    if index == num_layers + 1 {
        FINAL_PRENORM.into()
    } else {
        index.to_string()
    }
}

/// The layers an answer holds: resolved indices in `0..=num_layers + 1` (`num_layers + 1` is
/// [`FINAL_PRENORM`]), each once, in the order the caller asked (the answer's column order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSet {
    indices: Vec<usize>,
    num_layers: usize,
}

impl LayerSet {
    /// Resolves and checks the caller's layers for a model of `num_layers` decoder layers: at
    /// least one, each a known name or an index in range, none named twice (`-1` and `L` are the
    /// same layer). The message of an error says what is wrong and how to ask instead.
    pub fn resolve(layers: &[LayerRef], num_layers: usize) -> Result<Self, String> {
        if layers.is_empty() {
            return Err("\"layers\" must name at least one index".into());
        }
        if layers.len() > num_layers + 2 {
            return Err(format!(
                "\"layers\" names {} layers; this model has {} (indices 0..={num_layers} and \"{FINAL_PRENORM}\"), \
                 and each may be asked once",
                layers.len(),
                num_layers + 2
            ));
        }
        let indices = layers.iter().map(|l| resolve_one(l, num_layers)).collect::<Result<Vec<_>, _>>()?;
        let mut seen = vec![None; num_layers + 2];
        for (k, &r) in indices.iter().enumerate() {
            if let Some(first) = seen[r].replace(k) {
                return Err(format!(
                    "\"layers\" names {} twice ({} and {}); ask for each layer once",
                    label(r, num_layers),
                    layers[first],
                    layers[k]
                ));
            }
        }
        Ok(LayerSet { indices, num_layers })
    }

    /// No layer at all: an answer of next-token log-probabilities only (its `hidden_states` is
    /// `[rows, 0, hidden]`).
    pub fn none(num_layers: usize) -> Self {
        LayerSet { indices: Vec::new(), num_layers }
    }

    /// [`LayerSet::resolve`] for layers given by index only (a workload file's list).
    pub fn of_indices(layers: &[i64], num_layers: usize) -> Result<Self, String> {
        Self::resolve(&layers.iter().map(|&i| LayerRef::Index(i)).collect::<Vec<_>>(), num_layers)
    }

    /// The resolved indices, in the answer's column order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// How many layers (columns) the answer holds.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True only for [`LayerSet::none`]: [`LayerSet::resolve`] gives at least one layer.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The decoder layers of the model the set was resolved for.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Column `col`'s name: `"17"` or `"final_prenorm"`.
    pub fn name(&self, col: usize) -> String {
        name(self.indices[col], self.num_layers)
    }

    /// Every column's label, as the answer's `layers` metadata lists them.
    pub fn labels(&self) -> Vec<serde_json::Value> {
        self.indices.iter().map(|&l| label(l, self.num_layers)).collect()
    }
}

/// One caller layer as an index in `0..=num_layers + 1`.
fn resolve_one(layer: &LayerRef, num_layers: usize) -> Result<usize, String> {
    match layer {
        LayerRef::Index(i) => {
            let n = num_layers as i64;
            let r = if *i < 0 { n + 1 + i } else { *i };
            if (0..=n).contains(&r) {
                Ok(r as usize)
            } else {
                Err(format!(
                    "layer index {i} is out of range: this model has {n} layers, so indices go from \
                     {} to {n} (0 = embeddings, {n} = final normed output)",
                    -(n + 1)
                ))
            }
        }
        LayerRef::Name(n) if n == FINAL_PRENORM => Ok(num_layers + 1),
        LayerRef::Name(n) => Err(format!(
            "unknown layer name {n:?}: name layers by index, or \"{FINAL_PRENORM}\" for the last decoder \
             layer's output before the final norm"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(v: &[&str]) -> Vec<LayerRef> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn indices_resolve_from_both_ends_and_keep_the_callers_order() {
        let n = 4;
        let set = LayerSet::resolve(&refs(&["0", "-1", "2", "-5", "final_prenorm"]), n);
        let err = set.unwrap_err();
        assert!(err.contains("twice") && err.contains("0 and -5"), "{err}");
        let set = LayerSet::resolve(&refs(&["3", "-1", "final_prenorm", "0"]), n).unwrap();
        assert_eq!(set.indices(), &[3, 4, 5, 0]);
        assert_eq!(serde_json::Value::from(set.labels()), serde_json::json!([3, 4, "final_prenorm", 0]));
        assert_eq!((set.name(2), set.len(), set.num_layers()), ("final_prenorm".to_string(), 4, n));
        assert_eq!(LayerSet::of_indices(&[-1, 1], n).unwrap().indices(), &[4, 1]);
    }

    #[test]
    fn bad_layer_lists_say_why() {
        let err = |v: &[&str]| LayerSet::resolve(&refs(v), 4).unwrap_err();
        assert!(err(&[]).contains("at least one"));
        for bad in ["5", "-6"] {
            let e = err(&[bad]);
            assert!(e.contains("out of range") && e.contains("from -5 to 4"), "{e}");
        }
        assert!(err(&["final_prenorm", "final_prenorm"]).contains("\"final_prenorm\" twice"));
        assert!(err(&["0", "1", "2", "3", "4", "final_prenorm", "-1"]).contains("names 7 layers; this model has 6"));
        let unknown = LayerSet::resolve(&[LayerRef::Name("last".into())], 4).unwrap_err();
        assert!(unknown.contains("unknown layer name \"last\""), "{unknown}");
        assert!("first".parse::<LayerRef>().is_err());
    }
}
