//! Charts of compared records and of a class (plotters): grouped bars of throughput, or lines
//! of throughput against a swept batch or input size. PNG or SVG by the file's extension.
//!
//! Text needs a TrueType font. plotters is built without system-font discovery (which would
//! need fontconfig at build time), so the first font [`crate::fonts`] finds in the usual
//! places is loaded once; `WORKSHOP_FONT=FILE.ttf` chooses another.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::bench::compare::{Comparison, Shape};

/// Pixels of every chart.
pub const SIZE: (u32, u32) = (960, 540);

/// Load a font for plotters once per process; the error says what to install.
fn ensure_font() -> Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            for path in crate::fonts::candidates() {
                if let Ok(bytes) = std::fs::read(&path) {
                    // plotters keeps fonts for the life of the process: one font, loaded once.
                    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                        .is_ok()
                    {
                        return Ok(());
                    }
                }
            }
            Err(crate::fonts::none_found())
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Draw on a PNG or SVG file chosen by `path`'s extension.
fn on_file(
    path: &Path,
    draw: &dyn Fn(&DrawingArea<BitMapBackend, Shift>) -> Result<()>,
    draw_svg: &dyn Fn(&DrawingArea<SVGBackend, Shift>) -> Result<()>,
) -> Result<()> {
    ensure_font()?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create `{}`", parent.display()))?;
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("png") => {
            let area = BitMapBackend::new(path, SIZE).into_drawing_area();
            draw(&area)?;
            area.present()
                .with_context(|| format!("cannot write `{}`", path.display()))?;
        }
        Some("svg") => {
            let area = SVGBackend::new(path, SIZE).into_drawing_area();
            draw_svg(&area)?;
            area.present()
                .with_context(|| format!("cannot write `{}`", path.display()))?;
        }
        _ => bail!("`{}`: a chart is a .png or .svg file", path.display()),
    }
    Ok(())
}

/// A bar of a grouped bar chart.
pub struct Bar {
    /// The group (x axis).
    pub group: String,
    /// The series (colour, legend).
    pub series: String,
    pub value: f64,
    /// The spread behind the value (slowest and fastest iteration), drawn as a whisker.
    pub range: Option<(f64, f64)>,
}

impl Bar {
    /// Where its drawing ends: the bar, or its whisker above it.
    fn top(&self) -> f64 {
        self.range.map_or(self.value, |r| r.1.max(self.value))
    }
}

/// Grouped bars: one group per distinct `group`, one colour per distinct `series`.
pub fn bars(path: &Path, title: &str, y_label: &str, bars: &[Bar]) -> Result<()> {
    on_file(path, &|a| draw_bars(a, title, y_label, bars), &|a| {
        draw_bars(a, title, y_label, bars)
    })
}

fn distinct(values: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for v in values {
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

fn draw_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    y_label: &str,
    bars: &[Bar],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE).map_err(plot_error)?;
    let groups = distinct(bars.iter().map(|b| b.group.clone()));
    let series = distinct(bars.iter().map(|b| b.series.clone()));
    let top = bars
        .iter()
        .map(Bar::top)
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.15;
    let n = groups.len() as f64;
    let colors: Vec<RGBAColor> = (0..series.len())
        .map(|i| Palette99::pick(i).to_rgba())
        .collect();
    let area = match series.len() {
        0 | 1 => area.clone(),
        _ => beside_legend(area, &series, &colors, LegendMark::Box)?,
    };
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..top)
        .map_err(plot_error)?;
    let names = groups.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .max_light_lines(1)
        .x_labels(groups.len())
        .x_label_formatter(&move |x| {
            let c = x.round();
            if (x - c).abs() < 1e-6 && c >= 0.0 && (c as usize) < names.len() {
                names[c as usize].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(plot_error)?;
    // Within a group, the bars present share its width in series order.
    let slot = |b: &Bar| -> (f64, f64) {
        let present: Vec<&String> = series
            .iter()
            .filter(|s| bars.iter().any(|x| x.group == b.group && &x.series == *s))
            .collect();
        let width = 0.8 / present.len().max(1) as f64;
        let i = present.iter().position(|s| **s == b.series).unwrap_or(0) as f64;
        let g = groups.iter().position(|x| *x == b.group).unwrap_or(0) as f64;
        (g - 0.4 + width * i, width)
    };
    for (s, color) in series.iter().zip(&colors) {
        let mine: Vec<&Bar> = bars.iter().filter(|b| &b.series == s).collect();
        let rects: Vec<Rectangle<(f64, f64)>> = mine
            .iter()
            .map(|b| {
                let (x0, width) = slot(b);
                Rectangle::new([(x0, 0.0), (x0 + width * 0.95, b.value)], color.filled())
            })
            .collect();
        chart.draw_series(rects).map_err(plot_error)?;
        for b in mine {
            let (x0, width) = slot(b);
            // The spread: a whisker from the slowest to the fastest iteration.
            if let Some((lo, hi)) = b.range {
                let mid = x0 + width * 0.475;
                let cap = width * 0.15;
                let ink = BLACK.stroke_width(1);
                let whisker = [
                    vec![(mid, lo), (mid, hi)],
                    vec![(mid - cap, lo), (mid + cap, lo)],
                    vec![(mid - cap, hi), (mid + cap, hi)],
                ];
                chart
                    .draw_series(whisker.into_iter().map(|p| PathElement::new(p, ink)))
                    .map_err(plot_error)?;
            }
            let style = TextStyle::from(("sans-serif", 13).into_font()).pos(
                plotters::style::text_anchor::Pos::new(
                    plotters::style::text_anchor::HPos::Center,
                    plotters::style::text_anchor::VPos::Bottom,
                ),
            );
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{:.1}", b.value),
                    (x0 + width * 0.475, b.top() + top * 0.01),
                    style,
                )))
                .map_err(plot_error)?;
        }
    }
    Ok(())
}

/// How a legend entry shows its series.
#[derive(Clone, Copy)]
enum LegendMark {
    Box,
    Line,
}

/// Draw the legend in a column at the right of `area`, outside the plot (so it never hides
/// a bar or a point), and return the area left for the plot.
fn beside_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    labels: &[String],
    colors: &[RGBAColor],
    mark: LegendMark,
) -> Result<DrawingArea<DB, Shift>>
where
    DB::ErrorType: 'static,
{
    let (w, _) = area.dim_in_pixel();
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0) as u32;
    // About 8 pixels a character at 14 points, the mark and margins; at most 40% of the width.
    let column = (longest * 8 + 48).min(w * 2 / 5);
    let (plot, side) = area.split_horizontally(w - column);
    let font = ("sans-serif", 14).into_font();
    let max_chars = ((column.saturating_sub(40)) / 8).max(4) as usize;
    for (i, (label, color)) in labels.iter().zip(colors).enumerate() {
        let y = 60 + 22 * i as i32;
        match mark {
            LegendMark::Box => side
                .draw(&Rectangle::new([(8, y - 6), (20, y + 6)], color.filled()))
                .map_err(plot_error)?,
            LegendMark::Line => side
                .draw(&PathElement::new(
                    vec![(6, y), (22, y)],
                    color.stroke_width(2),
                ))
                .map_err(plot_error)?,
        }
        let shown = match label.chars().count() > max_chars {
            true => format!("{}…", label.chars().take(max_chars - 1).collect::<String>()),
            false => label.clone(),
        };
        side.draw(&Text::new(shown, (28, y - 7), font.clone()))
            .map_err(plot_error)?;
    }
    Ok(plot)
}

/// A line of a line chart: its points (x, y).
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Lines of y against x.
pub fn lines(path: &Path, title: &str, x_label: &str, y_label: &str, lines: &[Line]) -> Result<()> {
    on_file(
        path,
        &|a| draw_lines(a, title, x_label, y_label, lines),
        &|a| draw_lines(a, title, x_label, y_label, lines),
    )
}

fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE).map_err(plot_error)?;
    let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let top = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.15;
    let pad = ((x1 - x0) * 0.05).max(0.5);
    let colors: Vec<RGBAColor> = (0..lines.len())
        .map(|i| Palette99::pick(i).to_rgba())
        .collect();
    let labels: Vec<String> = lines.iter().map(|l| l.label.clone()).collect();
    let area = beside_legend(area, &labels, &colors, LegendMark::Line)?;
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x0 - pad..x1 + pad, 0.0..top)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .max_light_lines(1)
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(plot_error)?;
    for (l, &color) in lines.iter().zip(&colors) {
        let mut pts = l.points.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(plot_error)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(plot_error)?;
    }
    Ok(())
}

fn plot_error<E: std::error::Error + Send + Sync + 'static>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart failed: {e}")
}

/// The chart of a comparison: lines for a sweep, grouped bars otherwise.
pub fn comparison(c: &Comparison, path: &Path) -> Result<()> {
    match &c.shape {
        Shape::Bars => {
            // Groups by configuration, series by where it ran; records that would share a bar
            // (repeated runs) become series of their own.
            let mut bars: Vec<Bar> = c
                .rows
                .iter()
                .map(|r| Bar {
                    group: format!("{} {} b{}", r.network, r.precision, r.batch),
                    series: format!("{} ({})", r.device, r.backend),
                    value: r.throughput,
                    range: Some(r.throughput_range),
                })
                .collect();
            let shared = bars.iter().enumerate().any(|(i, a)| {
                bars[i + 1..]
                    .iter()
                    .any(|b| a.group == b.group && a.series == b.series)
            });
            if shared {
                for (b, r) in bars.iter_mut().zip(&c.rows) {
                    b.series = r.label.clone();
                }
            }
            self::bars(path, "Throughput", "images/s", &bars)
        }
        Shape::Lines { param } => {
            let mut lines: Vec<Line> = Vec::new();
            for r in &c.rows {
                let label = format!("{} {} {} ({})", r.network, r.precision, r.device, r.backend);
                let x = if param == "batch size" {
                    r.batch
                } else {
                    r.input_size
                } as f64;
                match lines.iter_mut().find(|l| l.label == label) {
                    Some(l) => l.points.push((x, r.throughput)),
                    None => lines.push(Line {
                        label,
                        points: vec![(x, r.throughput)],
                    }),
                }
            }
            self::lines(
                path,
                &format!("Throughput against {param}"),
                param,
                "images/s",
                &lines,
            )
        }
    }
}
