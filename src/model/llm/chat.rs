//! Chat templates: the Jinja template an instruction-tuned model folder carries
//! (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`), rendered as
//! transformers' `apply_chat_template(..., add_generation_prompt=True)` renders it — the same
//! whitespace rules (`trim_blocks`, `lstrip_blocks`), the same helpers (`raise_exception`,
//! `strftime_now`, a `tojson` that writes Python's `json.dumps`), Python's string methods, and
//! the tokenizer's special tokens as variables — so `workshop generate --chat` feeds the model
//! the ids transformers would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

/// A model folder's chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    /// Where it was read, for messages.
    path: PathBuf,
    source: String,
    /// `bos_token`, `eos_token`, … as `tokenizer_config.json` names them.
    tokens: Vec<(String, String)>,
}

/// The special tokens transformers passes to every template.
const SPECIAL: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

impl ChatTemplate {
    /// The template of folder `dir`, or `None` when it has none.
    pub fn open(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = if config_path.is_file() {
            let text = crate::files::read_text(&config_path)?;
            serde_json::from_str(&text)
                .with_context(|| format!("`{}` is not JSON", config_path.display()))?
        } else {
            Json::Null
        };
        let tokens = SPECIAL
            .iter()
            .filter_map(|&k| {
                // A token is a string or an AddedToken object with its `content`.
                let v = config.get(k)?;
                let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
                Some((k.to_string(), text.to_string()))
            })
            .collect();
        let file = dir.join("chat_template.jinja");
        let (path, source) = if file.is_file() {
            (file.clone(), crate::files::read_text(&file)?)
        } else {
            let source = match config.get("chat_template") {
                None | Some(Json::Null) => return Ok(None),
                Some(Json::String(s)) => s.clone(),
                // Several named templates: the one called `default`.
                Some(Json::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .with_context(|| {
                        format!(
                            "`{}`: chat_template lists no template named `default`",
                            config_path.display()
                        )
                    })?
                    .to_string(),
                Some(_) => bail!(
                    "`{}`: chat_template is neither text nor a list of named templates",
                    config_path.display()
                ),
            };
            (config_path, source)
        };
        let template = ChatTemplate {
            path,
            source,
            tokens,
        };
        // Syntax errors are found now, with the line, rather than at the first prompt.
        template.environment()?;
        Ok(Some(template))
    }

    fn environment(&self) -> Result<Environment<'_>> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<(), Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_function("strftime_now", |format: String| strftime(&format, now()));
        env.add_filter("tojson", tojson);
        env.add_template("chat_template", &self.source)
            .map_err(|e| anyhow::anyhow!("`{}`: chat template: {e}", self.path.display()))?;
        Ok(env)
    }

    /// The text of a conversation of `(role, content)` messages, ending where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[(&str, &str)]) -> Result<String> {
        let env = self.environment()?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|&(role, content)| {
                Value::from(BTreeMap::from([
                    ("role", Value::from(role)),
                    ("content", Value::from(content)),
                ]))
            })
            .collect();
        let mut vars: BTreeMap<&str, Value> = self
            .tokens
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from(v.as_str())))
            .collect();
        vars.insert("messages", Value::from(messages));
        vars.insert("add_generation_prompt", Value::from(true));
        env.get_template("chat_template")
            .and_then(|t| t.render(vars))
            .map_err(|e| anyhow::anyhow!("`{}`: chat template: {e}", self.path.display()))
    }
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)` as transformers' `tojson` writes
/// it: `", "` and `": "` between items (`","` at line ends when indented), no HTML escapes.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    for k in ["ensure_ascii", "separators", "sort_keys"] {
        let _: Option<Value> = kwargs.get(k)?;
    }
    kwargs.assert_all_used()?;
    let bad = |e: serde_json::Error| Error::new(ErrorKind::InvalidOperation, e.to_string());
    let json = serde_json::to_value(&value).map_err(bad)?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let f = serde_json::ser::PrettyFormatter::with_indent(&pad);
            serde::Serialize::serialize(
                &json,
                &mut serde_json::Serializer::with_formatter(&mut out, f),
            )
        }
        None => serde::Serialize::serialize(
            &json,
            &mut serde_json::Serializer::with_formatter(&mut out, Spaced),
        ),
    };
    written.map_err(bad)?;
    Ok(Value::from_safe_string(
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

/// Python's default JSON separators on one line.
struct Spaced;

impl serde_json::ser::Formatter for Spaced {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// Seconds since the Unix epoch, now (UTC).
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `strftime` for the codes chat templates use (a date, a time), in UTC; other codes are kept
/// as written.
fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's `civil_from_days`).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    let name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('b') => out += &name[..3],
            Some('B') => out += name,
            Some('H') => out += &format!("{:02}", rest / 3600),
            Some('M') => out += &format!("{:02}", rest / 60 % 60),
            Some('S') => out += &format!("{:02}", rest % 60),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_dates_as_python_does() {
        // 2024-07-26 13:05:09 UTC.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %B %y %% %j", t),
            "2024-07-26 13:05:09 July 24 % %j"
        );
        assert_eq!(strftime("%d %b %Y", 951_782_400), "29 Feb 2000");
    }

    /// A ChatML template (Qwen's form) with Python's string methods, `raise_exception` and
    /// `tojson`, read from tokenizer_config.json with an AddedToken-style EOS.
    #[test]
    fn templates_render_as_transformers_does() {
        let dir = tempfile::tempdir().unwrap();
        let template = r#"{%- if messages[0].role != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}
{% for m in messages %}
  {% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
<|im_start|>{{ m.role }}
{{ m.content.strip() }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ {'a': [1, 'é<'], 'b': none} | tojson }}{{ eos_token }}"#;
        let config = serde_json::json!({
            "chat_template": template,
            "eos_token": {"content": "<|im_end|>", "lstrip": false},
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::open(dir.path()).unwrap().unwrap();
        let text = t.render(&[("user", "  hi there ")]).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n\
             <|im_start|>assistant\n{\"a\": [1, \"é<\"], \"b\": null}<|im_end|>"
        );
        let err = t.render(&[("robot", "x")]).unwrap_err().to_string();
        assert!(err.contains("bad role robot"), "{err}");
        // A chat_template.jinja file wins over the config's; a syntax error names the file.
        std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").unwrap();
        let err = ChatTemplate::open(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("chat_template.jinja") && err.contains("syntax"),
            "{err}"
        );
    }
}
