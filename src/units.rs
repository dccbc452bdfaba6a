//! Numbers as people read them: bytes in binary units, counts with metric prefixes, durations,
//! grouped digits, and the worksheet's number format. Plain functions with no dependencies, so
//! every layer (errors in the backends, the course's check texts, the reports) writes numbers
//! the same way.

/// `3 passed, 1 failed`: each count that is not zero with what it counts, joined; `none`
/// when every count is zero.
pub fn nonzero_counts(counts: &[(usize, &str)], none: &str) -> String {
    let parts: Vec<String> = (counts.iter())
        .filter(|&&(n, _)| n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
    match parts.is_empty() {
        true => none.to_string(),
        false => parts.join(", "),
    }
}

/// Bytes in binary units with one decimal (`1.5 GiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// 25557032 → "25,557,032".
pub fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A number with sensible precision for the worksheet; NaN and ±∞ (a ratio over a zero) are
/// "not defined".
pub fn number(v: f64) -> String {
    if !v.is_finite() {
        return "not defined (division by zero)".into();
    }
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.3e}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// A count with a metric prefix and a unit: `si(4.09e9, "MACs")` is `4.09 GMACs`,
/// `si(25.56e6, "")` is `25.56 M`, small counts stay whole (`128`).
pub fn si(v: f64, unit: &str) -> String {
    match [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
        .into_iter()
        .find(|(d, _)| v.abs() >= *d)
    {
        Some((div, prefix)) => format!("{:.2} {prefix}{unit}", v / div),
        None if unit.is_empty() => format!("{v:.0}"),
        None => format!("{v:.0} {unit}"),
    }
}

/// A duration in ns as `12.34 ms`, `1.23 s` or `45.6 µs`.
pub fn duration_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

/// What a spreadsheet reads as the start of a formula (or hides one behind).
const FORMULA_STARTS: [char; 6] = ['=', '+', '-', '@', '\t', '\r'];

/// A text cell of a CSV file: quoted, and kept text where a spreadsheet would run it as a
/// formula (a leading `=`, `+`, `-`, `@`, tab or carriage return gets a `'` first; issue 27).
pub fn csv_text(s: &str) -> String {
    let s = if s.starts_with(FORMULA_STARTS) {
        format!("'{s}")
    } else {
        s.to_string()
    };
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A CSV field: as it is where it needs no quoting (ids, metric names), else [`csv_text`].
pub fn csv_field(s: &str) -> String {
    let plain = !s.contains([',', '"', '\n', '\r']) && !s.starts_with(FORMULA_STARTS);
    if plain { s.to_string() } else { csv_text(s) }
}

/// `s` safe to print on a terminal: control characters other than newline and tab (escape
/// sequences, NUL, carriage returns) are written as escapes (`\u{1b}`), so a name from a file
/// cannot recolour, move or clear the screen (issue 27).
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' | '\t' => out.push(c),
            c if c.is_control() => out.extend(c.escape_debug()),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// [`printable`] applied to every string (and object key) of a JSON value read from someone
/// else's file (a record, a rank, a classmate's results) before any of it is shown.
pub fn printable_json(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::String(s) => {
            if let std::borrow::Cow::Owned(p) = printable(s) {
                *s = p;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(printable_json),
        Value::Object(map) => {
            let entries = std::mem::take(map);
            for (k, mut item) in entries {
                printable_json(&mut item);
                map.insert(printable(&k).into_owned(), item);
            }
        }
        _ => {}
    }
}

/// Serde for an `f64` that may be NaN or ±∞, which JSON has no numbers for: written as the
/// strings `"NaN"`, `"inf"`, `"-inf"` (serde_json would write `null`, which then fails to read
/// back as a number), read back from those, from numbers, and from `null` (NaN). Use with
/// `#[serde(with = "crate::units::named_float")]`.
pub mod named_float {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// One value as JSON holds it.
    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    pub enum Repr {
        Number(f64),
        Named(String),
        Null(()),
    }

    impl From<f64> for Repr {
        fn from(v: f64) -> Repr {
            match v {
                v if v.is_finite() => Repr::Number(v),
                v if v.is_nan() => Repr::Named("NaN".into()),
                v if v > 0.0 => Repr::Named("inf".into()),
                _ => Repr::Named("-inf".into()),
            }
        }
    }

    impl Repr {
        pub fn value(self) -> Result<f64, String> {
            match self {
                Repr::Number(v) => Ok(v),
                Repr::Null(()) => Ok(f64::NAN),
                Repr::Named(s) => match s.as_str() {
                    "NaN" => Ok(f64::NAN),
                    "inf" => Ok(f64::INFINITY),
                    "-inf" => Ok(f64::NEG_INFINITY),
                    other => Err(format!("`{other}` is not a number")),
                },
            }
        }
    }

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        Repr::from(*v).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Repr::deserialize(d)?
            .value()
            .map_err(serde::de::Error::custom)
    }
}

/// What is wrong with a network's output, if anything: how many logits are NaN or infinite
/// (a NaN or infinity in the input or the weights, or an FP16 overflow), said rather than
/// passed on as a result (issue 27).
pub fn non_finite(values: &[f32]) -> Option<String> {
    let nan = values.iter().filter(|v| v.is_nan()).count();
    let inf = values.iter().filter(|v| v.is_infinite()).count();
    (nan + inf > 0).then(|| {
        format!(
            "{nan} NaN and {inf} infinite value(s) among the {} logits: the input or the weights hold non-finite values, or the precision overflowed",
            values.len()
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn csv_text_never_starts_a_formula() {
        assert_eq!(super::csv_field("00-first"), "00-first");
        assert_eq!(super::csv_field("a,b"), "\"a,b\"");
        assert_eq!(super::csv_field("=cmd"), "\"'=cmd\"");
        assert_eq!(super::csv_text("Ada"), "\"Ada\"");
        assert_eq!(super::csv_text("say \"hi\""), "\"say \"\"hi\"\"\"");
        for f in ["=1+1", "+1", "-1", "@SUM(A1)", "\t=1"] {
            assert!(super::csv_text(f).starts_with("\"'"), "{f}");
        }
    }

    #[test]
    fn printable_escapes_control_characters_only() {
        assert_eq!(super::printable("plain\ttext\n"), "plain\ttext\n");
        assert_eq!(super::printable("a\x1b[31mb\0"), "a\\u{1b}[31mb\\0");
        let mut v = serde_json::json!({"k\x07": ["\r", 1]});
        super::printable_json(&mut v);
        assert_eq!(v, serde_json::json!({"k\\u{7}": ["\\r", 1]}));
    }
}
