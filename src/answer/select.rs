//! Token selection: which rows of each input an answer holds (`tokens` in a request, `--tokens`
//! of `layertap bulk`; one parser for both). The selection is resolved to positions once the
//! inputs are tokenized; the engine then copies only those rows off the device.

use serde_json::Value;

use crate::tokenizer::Tokenized;

/// The positions one input keeps, or why its selection is invalid.
type PickFn<'a> = dyn Fn(usize, &Tokenized) -> Result<Vec<u32>, String> + 'a;

/// What `tokens` asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Selection {
    /// Every token (the default).
    #[default]
    All,
    /// Tokens whose loss mask is 1 (assistant turns of chats; every token of other inputs).
    Assistant,
    /// The last `k` tokens of each input (all of a shorter input).
    Last(usize),
    /// `[start, end)` ranges per input, ascending and not overlapping.
    Ranges(Vec<Vec<(usize, usize)>>),
}

fn expected() -> String {
    "\"tokens\" must be \"all\", \"assistant\", {\"last\": k} or one list of [start, end] pairs per input".into()
}

impl Selection {
    /// Reads `tokens` for a request of `n_inputs` inputs. The message of an error says what is
    /// wrong and where.
    pub fn parse(v: Option<&Value>, n_inputs: usize) -> Result<Self, String> {
        let Some(v) = v else { return Ok(Selection::All) };
        match v {
            Value::Null => Ok(Selection::All),
            Value::String(s) if s == "all" => Ok(Selection::All),
            Value::String(s) if s == "assistant" => Ok(Selection::Assistant),
            Value::String(s) => Err(format!("unknown \"tokens\" value {s:?}: {}", expected())),
            Value::Object(o) => {
                if o.len() != 1 || !o.contains_key("last") {
                    return Err(format!("a \"tokens\" object takes one key, \"last\": {}", expected()));
                }
                match o["last"].as_u64() {
                    Some(k) if k >= 1 => Ok(Selection::Last(usize::try_from(k).unwrap_or(usize::MAX))),
                    _ => Err(format!("\"tokens\": {{\"last\": k}} needs an integer k >= 1, got {}", o["last"])),
                }
            }
            Value::Array(per_input) => {
                if per_input.len() != n_inputs {
                    return Err(format!(
                        "\"tokens\" has {} entries for {n_inputs} inputs: give one list of [start, end] pairs per input",
                        per_input.len()
                    ));
                }
                let mut out = Vec::with_capacity(n_inputs);
                for (i, ranges) in per_input.iter().enumerate() {
                    let Value::Array(ranges) = ranges else {
                        return Err(format!("tokens[{i}] must be a list of [start, end] pairs, got {ranges}"));
                    };
                    let mut rs = Vec::with_capacity(ranges.len());
                    for (j, r) in ranges.iter().enumerate() {
                        let pair = r.as_array().filter(|a| a.len() == 2).and_then(|a| {
                            Some((usize::try_from(a[0].as_u64()?).ok()?, usize::try_from(a[1].as_u64()?).ok()?))
                        });
                        let Some((start, end)) = pair else {
                            return Err(format!(
                                "tokens[{i}][{j}] must be a pair [start, end] of non-negative integers, got {r}"
                            ));
                        };
                        if start >= end {
                            return Err(format!(
                                "tokens[{i}][{j}] = [{start}, {end}] is empty: a range [start, end) needs start < end"
                            ));
                        }
                        if let Some(&(_, prev_end)) = rs.last() {
                            if start < prev_end {
                                return Err(format!(
                                    "tokens[{i}][{j}] = [{start}, {end}] starts before the range ahead of it ends \
                                     ({prev_end}): give ranges in ascending order, without overlaps"
                                ));
                            }
                        }
                        rs.push((start, end));
                    }
                    out.push(rs);
                }
                Ok(Selection::Ranges(out))
            }
            other => Err(format!("\"tokens\" cannot be {other}: {}", expected())),
        }
    }

    /// Reads a command-line selection: `all`, `assistant` or `last:K` (K >= 1), the forms that
    /// apply to every input alike, through the same checks as a request's `tokens`.
    pub fn parse_flag(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let value = match s {
            "all" | "assistant" => Value::from(s),
            _ => match s.strip_prefix("last:").map(|k| k.trim().parse::<u64>()) {
                Some(Ok(k)) => serde_json::json!({ "last": k }),
                Some(Err(_)) => return Err(format!("{s:?}: last:K needs a whole number K >= 1, e.g. last:2")),
                None => return Err(format!("unknown --tokens value {s:?}; use all, assistant or last:K (K >= 1)")),
            },
        };
        Self::parse(Some(&value), 0).map_err(|e| format!("{s:?}: {e}"))
    }

    /// The request's `tokens` value for this selection; `None` for every row (the default).
    pub fn to_request(&self) -> Option<Value> {
        match self {
            Selection::All => None,
            Selection::Assistant => Some("assistant".into()),
            Selection::Last(k) => Some(serde_json::json!({ "last": k })),
            Selection::Ranges(r) => Some(
                r.iter()
                    .map(|rs| rs.iter().map(|&(a, b)| serde_json::json!([a, b])).collect::<Vec<_>>().into())
                    .collect::<Vec<Value>>()
                    .into(),
            ),
        }
    }

    /// How the selection is recorded in an answer's metadata.
    pub fn label(&self) -> String {
        match self {
            Selection::All => "all".into(),
            Selection::Assistant => "assistant".into(),
            Selection::Last(k) => format!("last:{k}"),
            Selection::Ranges(_) => "ranges".into(),
        }
    }

    /// The positions each tokenized input keeps, ascending; `None` for every position. Ranges
    /// past the end of their input are an error naming it.
    pub fn positions(&self, seqs: &[Tokenized]) -> Result<Option<Vec<Vec<u32>>>, String> {
        let pick = |f: &PickFn| seqs.iter().enumerate().map(|(i, s)| f(i, s)).collect::<Result<Vec<_>, _>>().map(Some);
        match self {
            Selection::All => Ok(None),
            Selection::Assistant => pick(&|_, s| {
                Ok(s.loss_mask.iter().enumerate().filter(|(_, &m)| m == 1).map(|(p, _)| p as u32).collect())
            }),
            Selection::Last(k) => pick(&|_, s| {
                let n = s.ids.len();
                Ok((n.saturating_sub(*k) as u32..n as u32).collect())
            }),
            Selection::Ranges(r) => pick(&|i, s| {
                let n = s.ids.len();
                let mut out = Vec::new();
                for (j, &(start, end)) in r[i].iter().enumerate() {
                    if end > n {
                        return Err(format!(
                            "tokens[{i}][{j}] = [{start}, {end}] ends past inputs[{i}], which has {n} tokens"
                        ));
                    }
                    out.extend(start as u32..end as u32);
                }
                Ok(out)
            }),
        }
    }
}

impl std::fmt::Display for Selection {
    /// The metadata label, which for the command-line forms is also the flag's text.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn seq(n: usize, mask: &[u8]) -> Tokenized {
        Tokenized { ids: (0..n as u32).collect(), loss_mask: mask.to_vec() }
    }

    #[test]
    fn each_form_selects_the_rows_it_names() {
        let seqs = vec![seq(5, &[0, 1, 1, 0, 1]), seq(2, &[0, 0])];
        let p = |v: Value| Selection::parse(Some(&v), 2).unwrap().positions(&seqs).unwrap();
        assert_eq!(Selection::parse(None, 2).unwrap().positions(&seqs).unwrap(), None);
        assert_eq!(p(json!("all")), None);
        assert_eq!(p(json!("assistant")), Some(vec![vec![1, 2, 4], vec![]]));
        assert_eq!(p(json!({"last": 3})), Some(vec![vec![2, 3, 4], vec![0, 1]]));
        assert_eq!(p(json!([[[0, 2], [3, 5]], [[1, 2]]])), Some(vec![vec![0, 1, 3, 4], vec![1]]));
        assert_eq!(p(json!([[], [[0, 2]]])), Some(vec![vec![], vec![0, 1]]));
    }

    #[test]
    fn the_command_line_forms_read_as_the_request_forms_and_back() {
        for (flag, sel) in
            [("all", Selection::All), ("assistant", Selection::Assistant), (" last:3 ", Selection::Last(3))]
        {
            let parsed = Selection::parse_flag(flag).unwrap();
            assert_eq!(parsed, sel);
            assert_eq!(Selection::parse(parsed.to_request().as_ref(), 0).unwrap(), sel, "{flag}");
            assert_eq!(parsed.to_string(), flag.trim());
        }
        let ranges = Selection::Ranges(vec![vec![(0, 2), (3, 5)], vec![]]);
        assert_eq!(Selection::parse(ranges.to_request().as_ref(), 2).unwrap(), ranges);
        assert!(Selection::parse_flag("last:0").unwrap_err().contains("k >= 1"));
        assert!(Selection::parse_flag("last:x").unwrap_err().contains("whole number"));
        assert!(Selection::parse_flag("first:2").unwrap_err().contains("unknown --tokens value"));
    }

    #[test]
    fn bad_selections_say_which_input_and_why() {
        let err = |v: Value| Selection::parse(Some(&v), 2).unwrap_err();
        assert!(err(json!("some")).contains("unknown"));
        assert!(err(json!({"last": 0})).contains("k >= 1"));
        assert!(err(json!({"first": 2})).contains("\"last\""));
        assert!(err(json!([[[0, 1]]])).contains("1 entries for 2 inputs"));
        assert!(err(json!([[[0, 1]], [[3, 3]]])).contains("tokens[1][0]"));
        assert!(err(json!([[[0, 4], [2, 5]], []])).contains("ascending"));
        assert!(err(json!([[[-1, 4]], []])).contains("non-negative"));
        assert!(err(json!([[[0, 1, 2]], []])).contains("pair"));
        assert!(err(json!(3)).contains("cannot be 3"));
        let seqs = vec![seq(5, &[1; 5]), seq(2, &[1; 2])];
        let past = Selection::parse(Some(&json!([[[0, 5]], [[1, 3]]])), 2).unwrap().positions(&seqs).unwrap_err();
        assert!(past.contains("inputs[1], which has 2 tokens"), "{past}");
    }
}
