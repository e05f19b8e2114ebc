//! The input of `layertap bulk`, read row by row: JSONL (one object a line) or Parquet (the
//! columns named on the command line, one row group at a time, as pyarrow and Hugging Face
//! `datasets` write them). A row that cannot be a request (a null, a value of the wrong type,
//! a line that is not JSON) comes out as [`Row::Bad`], with its id and row number, and never
//! stops the reading; only a file that cannot be read at all does.

use std::io::BufRead;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row as PqRow};
use parquet::schema::types::{Type, TypePtr};
use serde_json::{json, Map, Value};

use crate::cli::BulkArgs;

/// One sample of the input.
pub struct Sample {
    /// The sample's row in the input (from 0; JSONL: among its non-empty lines).
    pub index: usize,
    pub id: String,
    /// The request's input: `{"text"}`, `{"messages"}` or `{"input_ids"}`.
    pub input: Value,
}

/// A row as read: a sample, or one that cannot be a request and why.
pub enum Row {
    Ok(Sample),
    Bad { index: usize, id: String, error: String },
}

impl Row {
    pub fn id(&self) -> &str {
        match self {
            Row::Ok(s) => &s.id,
            Row::Bad { id, .. } => id,
        }
    }
}

/// What kind of value the input column holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Text,
    Messages,
    Ids,
}

impl Kind {
    /// The key of the request's input for this kind.
    fn key(self) -> &'static str {
        match self {
            Kind::Text => "text",
            Kind::Messages => "messages",
            Kind::Ids => "input_ids",
        }
    }
}

/// Where the input is and which of its columns (keys) to read.
#[derive(Clone, Debug)]
pub struct Input {
    pub path: PathBuf,
    parquet: bool,
    /// The column named on the command line for each kind of input.
    columns: Vec<(Kind, String)>,
    id_column: String,
}

impl Input {
    /// Checks the command line's column options against the kind of file (by its extension).
    pub fn new(a: &BulkArgs, path: &Path) -> anyhow::Result<Input> {
        let parquet = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
        let columns: Vec<(Kind, String)> =
            [(Kind::Text, &a.text_column), (Kind::Messages, &a.messages_column), (Kind::Ids, &a.ids_column)]
                .into_iter()
                .filter_map(|(k, c)| c.clone().map(|c| (k, c)))
                .collect();
        if parquet && columns.len() != 1 {
            anyhow::bail!(
                "a Parquet input needs exactly one of --text-column, --messages-column or --ids-column (the \
                 column holding the input), {} given",
                columns.len()
            );
        }
        Ok(Input { path: path.to_path_buf(), parquet, columns, id_column: a.id_column.clone() })
    }

    /// Reads every row in order and hands it to `f` until `f` breaks. With `ids_only`, a
    /// Parquet input reads its id column only and every row comes out as a sample with a null
    /// input (for counting and sharding).
    pub fn for_each(&self, ids_only: bool, f: impl FnMut(Row) -> ControlFlow<()>) -> anyhow::Result<()> {
        if self.parquet {
            self.parquet_rows(ids_only, f)
        } else {
            self.jsonl_rows(f)
        }
    }

    fn jsonl_rows(&self, mut f: impl FnMut(Row) -> ControlFlow<()>) -> anyhow::Result<()> {
        let path = &self.path;
        let file = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        let mut index = 0;
        for (n, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
            let line = line.map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let row = self.jsonl_row(index, n + 1, &line);
            index += 1;
            if f(row).is_break() {
                break;
            }
        }
        Ok(())
    }

    /// One non-empty line (`line` its number from 1): its id taken out, the renamed keys renamed.
    fn jsonl_row(&self, index: usize, line: usize, text: &[u8]) -> Row {
        let fallback = format!("line-{line}");
        let bad = |id: String, error: String| Row::Bad { index, id, error: format!("line {line}: {error}") };
        let mut v: Value = match serde_json::from_slice(text) {
            Ok(v) => v,
            Err(e) => return bad(fallback, format!("not JSON: {e}")),
        };
        let Some(obj) = v.as_object_mut() else { return bad(fallback, "not a JSON object".into()) };
        let id = match obj.remove(&self.id_column) {
            Some(Value::String(s)) => s,
            Some(Value::Null) | None => fallback,
            Some(other) => other.to_string(),
        };
        for (kind, column) in &self.columns {
            if column != kind.key() {
                match obj.remove(column) {
                    Some(value) => {
                        obj.insert(kind.key().into(), value);
                    }
                    None => return bad(id, format!("no key {column:?}")),
                }
            }
        }
        if let Some(msgs) = obj.get_mut("messages") {
            if let Err(e) = sharegpt_to_chat(msgs) {
                return bad(id, e);
            }
        }
        Row::Ok(Sample { index, id, input: v })
    }

    fn parquet_rows(&self, ids_only: bool, mut f: impl FnMut(Row) -> ControlFlow<()>) -> anyhow::Result<()> {
        let path = &self.path;
        let file = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        let reader = SerializedFileReader::new(file)
            .map_err(|e| anyhow::anyhow!("{}: not a Parquet file: {e}", path.display()))?;
        let schema = reader.metadata().file_metadata().schema();
        let field = |name: &str| -> Option<TypePtr> { schema.get_fields().iter().find(|t| t.name() == name).cloned() };
        let names = || schema.get_fields().iter().map(|t| t.name().to_string()).collect::<Vec<_>>().join(", ");
        let (kind, column) = self.columns[0].clone();
        let input_field = field(&column)
            .ok_or_else(|| anyhow::anyhow!("{} has no column {column:?} (its columns: {})", path.display(), names()))?;
        let id_field = field(&self.id_column);
        let mut projected: Vec<TypePtr> = id_field.iter().cloned().collect();
        if !ids_only {
            projected.push(input_field);
        }
        let mut index = 0;
        for g in 0..reader.num_row_groups() {
            let rows = reader.metadata().row_group(g).num_rows() as usize;
            if projected.is_empty() {
                // Only the row numbers are needed, and the metadata has them.
                for _ in 0..rows {
                    let row = Row::Ok(Sample { index, id: index.to_string(), input: Value::Null });
                    index += 1;
                    if f(row).is_break() {
                        return Ok(());
                    }
                }
                continue;
            }
            let projection = Type::group_type_builder(schema.name()).with_fields(projected.clone()).build()?;
            let group =
                reader.get_row_group(g).map_err(|e| anyhow::anyhow!("{}: row group {g}: {e}", path.display()))?;
            let iter = group
                .get_row_iter(Some(projection))
                .map_err(|e| anyhow::anyhow!("{}: row group {g}: {e}", path.display()))?;
            for r in iter {
                let r = r.map_err(|e| anyhow::anyhow!("{}: row group {g}, row {index}: {e}", path.display()))?;
                let row = self.parquet_row(index, &r, kind, &column, ids_only);
                index += 1;
                if f(row).is_break() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn parquet_row(&self, index: usize, r: &PqRow, kind: Kind, column: &str, ids_only: bool) -> Row {
        let get = |name: &str| r.get_column_iter().find(|(n, _)| n.as_str() == name).map(|(_, f)| f);
        let bad = |id: String, error: String| Row::Bad { index, id, error };
        let id = match get(&self.id_column) {
            None => index.to_string(),
            Some(Field::Str(s)) => s.clone(),
            Some(Field::Null) => return bad(index.to_string(), format!("column {:?}: the id is null", self.id_column)),
            Some(other) => match integer(other) {
                Some(n) => n.to_string(),
                None => {
                    return bad(
                        index.to_string(),
                        format!("column {:?}: an id is a string or an integer, not {}", self.id_column, type_of(other)),
                    )
                }
            },
        };
        if ids_only {
            return Row::Ok(Sample { index, id, input: Value::Null });
        }
        let value = get(column).unwrap_or(&Field::Null);
        match convert(kind, value) {
            Ok(v) => Row::Ok(Sample { index, id, input: json!({ kind.key(): v }) }),
            Err(e) => bad(id, format!("column {column:?}: {e}")),
        }
    }
}

/// An integer field's value.
fn integer(f: &Field) -> Option<i128> {
    Some(match f {
        Field::Byte(x) => i128::from(*x),
        Field::Short(x) => i128::from(*x),
        Field::Int(x) => i128::from(*x),
        Field::Long(x) => i128::from(*x),
        Field::UByte(x) => i128::from(*x),
        Field::UShort(x) => i128::from(*x),
        Field::UInt(x) => i128::from(*x),
        Field::ULong(x) => i128::from(*x),
        _ => return None,
    })
}

/// A field's kind, for messages.
fn type_of(f: &Field) -> &'static str {
    match f {
        Field::Null => "null",
        Field::Bool(_) => "a boolean",
        Field::Str(_) => "a string",
        Field::Bytes(_) => "bytes",
        Field::Float16(_) | Field::Float(_) | Field::Double(_) | Field::Decimal(_) => "a number",
        Field::Group(_) => "a struct",
        Field::ListInternal(_) => "a list",
        Field::MapInternal(_) => "a map",
        f if integer(f).is_some() => "an integer",
        _ => "a date or time",
    }
}

/// A Parquet value as the request's input of `kind`.
fn convert(kind: Kind, f: &Field) -> Result<Value, String> {
    match (kind, f) {
        (_, Field::Null) => Err("the value is null".into()),
        (Kind::Text, Field::Str(s)) => Ok(Value::String(s.clone())),
        (Kind::Ids, Field::ListInternal(list)) => {
            if list.elements().is_empty() {
                return Err("the input_ids list is empty".into());
            }
            let ids = list
                .elements()
                .iter()
                .enumerate()
                .map(|(i, e)| match integer(e) {
                    Some(n) if (0..=i128::from(u32::MAX)).contains(&n) => Ok(Value::from(n as u64)),
                    Some(n) => Err(format!("token id {i} is {n}, not a token id")),
                    None => Err(format!("token id {i} is {}, not an integer", type_of(e))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Value::Array(ids))
        }
        (Kind::Messages, Field::ListInternal(list)) => {
            if list.elements().is_empty() {
                return Err("the messages list is empty".into());
            }
            let msgs = list
                .elements()
                .iter()
                .enumerate()
                .map(|(i, e)| match e {
                    Field::Group(m) => message(m).map_err(|err| format!("message {i}: {err}")),
                    other => Err(format!(
                        "message {i} is {}, not a {{role, content}} or {{from, value}} struct",
                        type_of(other)
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Value::Array(msgs))
        }
        (Kind::Text, other) => Err(format!("the text is {}, not a string", type_of(other))),
        (Kind::Ids, other) => Err(format!("the input_ids are {}, not a list of integers", type_of(other))),
        (Kind::Messages, other) => Err(format!("the messages are {}, not a list of {{role, content}}", type_of(other))),
    }
}

/// One chat message: its string fields `role` and `content`, or ShareGPT's `from` and `value`
/// read as them (others are left out).
fn message(m: &PqRow) -> Result<Value, String> {
    let get = |key: &str| m.get_column_iter().find(|(n, _)| n.as_str() == key).map(|(_, f)| f);
    let sharegpt = get("role").is_none() && get("from").is_some();
    let keys =
        if sharegpt { [("from", "role"), ("value", "content")] } else { [("role", "role"), ("content", "content")] };
    let mut out = Map::new();
    for (key, name) in keys {
        match get(key) {
            Some(Field::Str(s)) if key == "from" => {
                out.insert(name.into(), sharegpt_role(s)?.into());
            }
            Some(Field::Str(s)) => {
                out.insert(name.into(), Value::String(s.clone()));
            }
            Some(other) => return Err(format!("its {key} is {}, not a string", type_of(other))),
            None => return Err(format!("it has no {key}")),
        }
    }
    Ok(Value::Object(out))
}

/// ShareGPT's speakers as chat roles.
const SHAREGPT_ROLES: [(&str, &str); 6] = [
    ("human", "user"),
    ("user", "user"),
    ("gpt", "assistant"),
    ("assistant", "assistant"),
    ("system", "system"),
    ("tool", "tool"),
];

/// The chat role of a ShareGPT speaker (`from`), or why there is none.
fn sharegpt_role(from: &str) -> Result<&'static str, String> {
    SHAREGPT_ROLES.iter().find(|(f, _)| f.eq_ignore_ascii_case(from)).map(|(_, r)| *r).ok_or_else(|| {
        let known: Vec<&str> = SHAREGPT_ROLES.iter().map(|(f, _)| *f).collect();
        format!("its from is {from:?}, not one of {}", known.join(", "))
    })
}

/// A ShareGPT message `{from, value}` rewritten as `{role, content}` in place; other messages
/// are left as they are.
fn sharegpt_message(msg: &mut Value) -> Result<(), String> {
    let Some(obj) = msg.as_object_mut() else { return Ok(()) };
    if obj.contains_key("role") || !obj.contains_key("from") {
        return Ok(());
    }
    let role = match obj.remove("from") {
        Some(Value::String(s)) => sharegpt_role(&s)?,
        other => return Err(format!("its from is {}, not a string", json_type(other.as_ref()))),
    };
    match obj.remove("value") {
        Some(v @ Value::String(_)) => {
            obj.insert("content".into(), v);
        }
        other => return Err(format!("its value is {}, not a string", json_type(other.as_ref()))),
    }
    obj.insert("role".into(), role.into());
    Ok(())
}

/// Every ShareGPT message of a JSONL chat rewritten as `{role, content}` (see
/// [`sharegpt_message`]); anything else is left for the server to judge.
fn sharegpt_to_chat(msgs: &mut Value) -> Result<(), String> {
    if let Some(list) = msgs.as_array_mut() {
        for (i, m) in list.iter_mut().enumerate() {
            sharegpt_message(m).map_err(|e| format!("message {i}: {e}"))?;
        }
    }
    Ok(())
}

/// A JSON value's kind, for messages.
fn json_type(v: Option<&Value>) -> &'static str {
    match v {
        None => "missing",
        Some(Value::Null) => "null",
        Some(Value::Bool(_)) => "a boolean",
        Some(Value::Number(_)) => "a number",
        Some(Value::String(_)) => "a string",
        Some(Value::Array(_)) => "a list",
        Some(Value::Object(_)) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ShareGPT's `{from, value}` become `{role, content}` with the speakers mapped; chats that
    /// already have roles pass unchanged; an unknown speaker or a non-string value is refused
    /// with the message's position.
    #[test]
    fn sharegpt_conversations_become_role_content_chats() {
        let mut chat = json!([
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "tool", "value": "{}"},
        ]);
        sharegpt_to_chat(&mut chat).unwrap();
        assert_eq!(
            chat,
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "tool", "content": "{}"},
            ])
        );
        let mut already = json!([{"role": "user", "content": "x", "from": "human"}]);
        let before = already.clone();
        sharegpt_to_chat(&mut already).unwrap();
        assert_eq!(already, before);
        let mut unknown = json!([{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]);
        let err = sharegpt_to_chat(&mut unknown).unwrap_err();
        assert!(err.starts_with("message 1: its from is \"bot\", not one of human"), "{err}");
        let mut number = json!([{"from": "gpt", "value": 3}]);
        assert_eq!(sharegpt_to_chat(&mut number).unwrap_err(), "message 0: its value is a number, not a string");
    }
}
