//! One SVG chart per family: a horizontal bar per (case, thread count) at its median, with a
//! whisker from min to max over the rounds. Results in different units get separate panels,
//! each with its own axis: logarithmic when its values span more than a factor of 20 (a system
//! call against a load), linear from zero otherwise. Bars are coloured by thread count; the
//! family's baseline case has a bold label.
//!
//! Text is left to the viewer's sans-serif font: no font files are read or embedded.

use crate::bench::model::{Family, Measured, RunInfo, Stats};
use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::report::table::fmt_num;
use std::io::Write;
use std::path::Path;
use svg::Document;
use svg::node::element::{Group, Line, Rectangle, Text, Title};

const WIDTH: f64 = 860.0;
const MARGIN: f64 = 16.0;
const LABEL_RIGHT: f64 = 200.0;
const PLOT_LEFT: f64 = 212.0;
const PLOT_RIGHT: f64 = 770.0;
const ROW: f64 = 26.0;
const BAR: f64 = 14.0;
const LINE: f64 = 16.0;
/// Characters of 12 px text that fit the chart's width, for wrapping.
const CHARS_PER_LINE: usize = 125;
const FONT: &str = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif";
/// Bar colours by thread count, in the order the counts appear.
const COLOURS: &[&str] = &[
    "#4c78a8", "#f58518", "#54a24b", "#b279a2", "#9d755d", "#e45756",
];
const INK: &str = "#222";
const MUTED: &str = "#555";
const GRID: &str = "#ddd";

/// How values map to the horizontal axis.
#[derive(Debug, PartialEq)]
enum Scale {
    /// From `10^low` to `10^high` (`high` need not be whole).
    Log { low: i32, high: f64 },
    /// From 0 to `max`, with ticks every `step`.
    Linear { max: f64, step: f64 },
}

/// The smallest of 1, 2, 5 times a power of ten that is at least `x` (> 0).
fn nice_ceiling(x: f64) -> f64 {
    let power = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|v| *v >= x * (1.0 - 1e-12))
        .unwrap_or(power * 10.0)
}

impl Scale {
    fn fit(values: &[f64]) -> Scale {
        let max = values.iter().copied().fold(0.0_f64, f64::max);
        let min_positive = values
            .iter()
            .copied()
            .filter(|v| *v > 0.0)
            .fold(f64::INFINITY, f64::min);
        if max > 0.0 && min_positive.is_finite() && max / min_positive > 20.0 {
            let low = min_positive.log10().floor() as i32;
            let high = nice_ceiling(max).log10().max(f64::from(low) + 1.0);
            return Scale::Log { low, high };
        }
        let max = if max > 0.0 { max } else { 1.0 };
        let step = nice_ceiling(max / 5.0);
        Scale::Linear {
            max: (max / step - 1e-9).ceil() * step,
            step,
        }
    }

    /// Position of `value` between 0 (left of plot) and 1 (right).
    fn fraction(&self, value: f64) -> f64 {
        let f = match *self {
            Scale::Log { low, high } => {
                if value <= 0.0 {
                    0.0
                } else {
                    (value.log10() - f64::from(low)) / (high - f64::from(low))
                }
            }
            Scale::Linear { max, .. } => value / max,
        };
        f.clamp(0.0, 1.0)
    }

    fn x(&self, value: f64) -> f64 {
        PLOT_LEFT + self.fraction(value) * (PLOT_RIGHT - PLOT_LEFT)
    }

    fn ticks(&self) -> Vec<f64> {
        match *self {
            Scale::Log { low, high } => {
                let mut ticks: Vec<f64> =
                    (low..=high.floor() as i32).map(|p| 10f64.powi(p)).collect();
                let end = 10f64.powf(high);
                if ticks.last().is_none_or(|last| end / last > 1.5) {
                    ticks.push(end);
                }
                ticks
            }
            Scale::Linear { max, step } => {
                let n = (max / step).round() as usize;
                (0..=n).map(|i| i as f64 * step).collect()
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Scale::Log { .. } => "log scale",
            Scale::Linear { .. } => "linear scale",
        }
    }
}

fn text(x: f64, y: f64, content: impl Into<String>) -> Text {
    Text::new(content)
        .set("x", round(x))
        .set("y", round(y))
        .set("font-family", FONT)
        .set("font-size", 12)
        .set("fill", INK)
}

fn line(x1: f64, y1: f64, x2: f64, y2: f64, colour: &str, width: f64) -> Line {
    Line::new()
        .set("x1", round(x1))
        .set("y1", round(y1))
        .set("x2", round(x2))
        .set("y2", round(y2))
        .set("stroke", colour)
        .set("stroke-width", width)
}

/// `0.1`, `1`, `10`, `2.5`: a tick value without trailing zeros.
fn tick_label(value: f64) -> String {
    format!("{}", (value * 1e6).round() / 1e6)
}

fn round(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// Splits `text` into lines of at most `width` characters, at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for word in text.split_whitespace() {
        if !current.is_empty() && current.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
    }
    if !current.is_empty() {
        lines.push(current);
    }
    lines
}

/// The thread counts and units of a family's results, each in the order it first appears.
struct Series<'a> {
    thread_counts: Vec<usize>,
    units: Vec<&'a str>,
}

impl<'a> Series<'a> {
    fn of(results: &[&'a Measured]) -> Self {
        let mut series = Series {
            thread_counts: Vec::new(),
            units: Vec::new(),
        };
        for m in results {
            if !series.thread_counts.contains(&m.threads) {
                series.thread_counts.push(m.threads);
            }
            if !series.units.contains(&m.unit.label()) {
                series.units.push(m.unit.label());
            }
        }
        series
    }

    fn several_threads(&self) -> bool {
        self.thread_counts.len() > 1
    }

    /// The bar colour of a thread count.
    fn colour(&self, threads: usize) -> &'static str {
        let index = self
            .thread_counts
            .iter()
            .position(|&t| t == threads)
            .unwrap_or(0);
        COLOURS[index % COLOURS.len()]
    }
}

/// The chart of one family's results.
pub fn chart(
    family: &Family,
    results: &[&Measured],
    machine: &Machine,
    info: &RunInfo,
) -> Document {
    let series = Series::of(results);
    let (mut body, mut y) = heading(family, machine, Group::new());
    if series.several_threads() {
        y += LINE + 4.0;
        body = legend(&series, body, y);
    }
    y += 12.0;
    for &unit in &series.units {
        let rows: Vec<(&Measured, Stats)> = results
            .iter()
            .filter(|m| m.unit.label() == unit)
            .map(|m| (*m, m.stats()))
            .collect();
        (body, y) = panel(family, &series, unit, &rows, info, body, y);
    }

    let height = y + MARGIN;
    Document::new()
        .set("width", WIDTH)
        .set("height", round(height))
        .set("viewBox", (0, 0, WIDTH, round(height)))
        .add(Title::new(format!("thiscpu bench {}", family.name)))
        .add(
            Rectangle::new()
                .set("width", "100%")
                .set("height", "100%")
                .set("fill", "white"),
        )
        .add(body)
}

/// The family's name, what it measures, and the machine it ran on, added to `body`; and the
/// height reached.
fn heading(family: &Family, machine: &Machine, mut body: Group) -> (Group, f64) {
    let mut y = MARGIN + 10.0;
    body = body.add(
        text(MARGIN, y, format!("thiscpu bench {}", family.name))
            .set("font-size", 16)
            .set("font-weight", "bold"),
    );
    y += 4.0;
    let mut notes = wrap(family.about, CHARS_PER_LINE);
    notes.extend(wrap(&machine.summary(), CHARS_PER_LINE));
    notes.extend(wrap(
        &format!(
            "{}; current_cpu() from {}",
            machine.rseq.summary(),
            machine.cpu_source
        ),
        CHARS_PER_LINE,
    ));
    for note in notes {
        y += LINE;
        body = body.add(text(MARGIN, y, note).set("fill", MUTED));
    }
    (body, y)
}

/// A swatch and a name per thread count, on the line at `y`.
fn legend(series: &Series, mut body: Group, y: f64) -> Group {
    let mut x = MARGIN;
    for &threads in &series.thread_counts {
        body = body
            .add(
                Rectangle::new()
                    .set("x", round(x))
                    .set("y", round(y - 10.0))
                    .set("width", 12)
                    .set("height", 12)
                    .set("fill", series.colour(threads)),
            )
            .add(text(
                x + 16.0,
                y,
                format!("{threads} thread{}", if threads == 1 { "" } else { "s" }),
            ));
        x += 100.0;
    }
    body
}

/// The panel of the results in one unit, below `y`: its axis, and a bar per result. The
/// height reached.
fn panel(
    family: &Family,
    series: &Series,
    unit: &str,
    rows: &[(&Measured, Stats)],
    info: &RunInfo,
    mut body: Group,
    y: f64,
) -> (Group, f64) {
    let values: Vec<f64> = rows.iter().flat_map(|(_, s)| [s.min, s.max]).collect();
    let scale = Scale::fit(&values);
    let top = y + 8.0;
    let bottom = top + ROW * rows.len() as f64;
    body = body.add(grid(&scale, top, bottom)).add(
        text(
            (PLOT_LEFT + PLOT_RIGHT) / 2.0,
            bottom + 34.0,
            format!(
                "{unit} ({}) · bar: median · whisker: min–max over {} rounds",
                scale.name(),
                info.rounds
            ),
        )
        .set("text-anchor", "middle"),
    );
    for (i, (m, s)) in rows.iter().enumerate() {
        let centre = top + ROW * i as f64 + ROW / 2.0;
        body = body.add(bar(family, series, &scale, unit, m, s, centre));
    }
    (body, bottom + 48.0)
}

/// The vertical lines at the scale's ticks, with their values, and the axis line.
fn grid(scale: &Scale, top: f64, bottom: f64) -> Group {
    let mut grid = Group::new();
    for tick in scale.ticks() {
        let x = scale.x(tick);
        grid = grid
            .add(line(x, top - 4.0, x, bottom, GRID, 1.0))
            .add(text(x, bottom + 16.0, tick_label(tick)).set("text-anchor", "middle"));
    }
    grid.add(line(PLOT_LEFT, top - 4.0, PLOT_LEFT, bottom, "#999", 1.0))
}

/// One result's row centred at `centre`: its label (bold for the baseline), the bar to its
/// median, the whisker from min to max, the median's value, and a tooltip with all of them.
fn bar(
    family: &Family,
    series: &Series,
    scale: &Scale,
    unit: &str,
    m: &Measured,
    s: &Stats,
    centre: f64,
) -> Group {
    let label = if series.several_threads() {
        format!("{} ×{}", m.case, m.threads)
    } else {
        m.case.to_owned()
    };
    let mut label_text = text(LABEL_RIGHT, centre + 4.0, label.clone()).set("text-anchor", "end");
    if family.baseline_for(m.case).as_deref() == Some(m.case) {
        label_text = label_text.set("font-weight", "bold");
    }
    let (x_min, x_median, x_max) = (scale.x(s.min), scale.x(s.median), scale.x(s.max));
    Group::new()
        .add(Title::new(format!(
            "{label}: median {} {unit}, min {}, max {}, {} rounds; {}",
            fmt_num(s.median),
            fmt_num(s.min),
            fmt_num(s.max),
            m.rounds.len(),
            m.how
        )))
        .add(label_text)
        .add(
            Rectangle::new()
                .set("x", PLOT_LEFT)
                .set("y", round(centre - BAR / 2.0))
                .set("width", round((x_median - PLOT_LEFT).max(1.0)))
                .set("height", BAR)
                .set("fill", series.colour(m.threads)),
        )
        .add(line(x_min, centre, x_max, centre, INK, 1.2))
        .add(line(x_min, centre - 4.0, x_min, centre + 4.0, INK, 1.2))
        .add(line(x_max, centre - 4.0, x_max, centre + 4.0, INK, 1.2))
        .add(text(
            x_max.max(x_median) + 6.0,
            centre + 4.0,
            fmt_num(s.median),
        ))
}

/// Writes the chart of `family` to `file` (already created at `path`).
pub fn write(
    path: &Path,
    file: std::fs::File,
    family: &Family,
    results: &[&Measured],
    machine: &Machine,
    info: &RunInfo,
) -> Result<()> {
    let document = chart(family, results, machine, info);
    let mut out = std::io::BufWriter::new(file);
    writeln!(out, r#"<?xml version="1.0" encoding="UTF-8"?>"#)
        .and_then(|()| svg::write(&mut out, &document))
        .and_then(|()| writeln!(out))
        .and_then(|()| out.flush())
        .map_err(|e| Error::write(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_fit_their_values() {
        let log = Scale::fit(&[0.3, 0.35, 180.0, 190.0]);
        assert_eq!(
            log,
            Scale::Log {
                low: -1,
                high: 200f64.log10()
            }
        );
        assert_eq!(log.ticks().len(), 5, "0.1, 1, 10, 100 and the end, 200");
        assert!((log.fraction(1.0) - 1.0 / (1.0 + 200f64.log10())).abs() < 1e-12);
        let linear = Scale::fit(&[20.0, 23.0, 24.6]);
        assert_eq!(
            linear,
            Scale::Linear {
                max: 25.0,
                step: 5.0
            }
        );
        assert_eq!(linear.ticks().last().copied(), Some(25.0));
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(1936.0), 2000.0);
    }

    #[test]
    fn long_text_wraps_at_spaces() {
        assert_eq!(wrap("aa bb cc", 5), ["aa bb", "cc"]);
        assert_eq!(wrap("", 5), Vec::<String>::new());
    }
}
