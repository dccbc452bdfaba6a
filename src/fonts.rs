//! The font charts are drawn with: `WORKSHOP_FONT`'s, else the first found in the usual
//! places. Apart from the charts themselves, so `doctor` can say it without drawing.

/// Where fonts usually are, on Linux (Debian, Arch, Fedora), macOS and Windows.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// The fonts charts would try, `WORKSHOP_FONT`'s first.
pub fn candidates() -> impl Iterator<Item = String> {
    let chosen = chosen().and_then(|p| p.to_str().map(String::from));
    chosen
        .into_iter()
        .chain(FONTS.iter().map(|p| p.to_string()))
}

/// `WORKSHOP_FONT`'s file, where it is set.
fn chosen() -> Option<std::path::PathBuf> {
    crate::settings::get().ok().and_then(|s| s.font.clone())
}

/// Why no chart can be drawn here, and what to do about it.
pub fn none_found() -> String {
    format!(
        "charts need a TrueType font and none was found (looked in {}); install one \
         (Debian/Ubuntu: `apt-get install fonts-dejavu-core`) or set WORKSHOP_FONT=FILE.ttf",
        FONTS[0]
    )
}

/// Whether `bytes` start as a TrueType or OpenType font does.
fn looks_like_a_font(bytes: &[u8]) -> bool {
    matches!(
        bytes.get(..4),
        Some(b"\0\x01\0\0" | b"true" | b"OTTO" | b"ttcf")
    )
}

/// The font charts will be drawn with (`doctor` shows it), or why there is none; a
/// `WORKSHOP_FONT` that is no font is named, with the fallback taken instead.
pub fn font() -> Result<String, String> {
    let usable = |p: &str| std::fs::read(p).is_ok_and(|b| looks_like_a_font(&b));
    let fallback = || FONTS.iter().find(|p| usable(p)).map(|p| p.to_string());
    let Some(chosen) = chosen() else {
        return fallback().ok_or_else(none_found);
    };
    match chosen.to_str() {
        Some(p) if usable(p) => Ok(p.to_string()),
        _ => Err(format!(
            "WORKSHOP_FONT={} is no TrueType font that can be read; {}",
            chosen.display(),
            fallback().map_or_else(none_found, |f| format!("charts would use {f}"))
        )),
    }
}
