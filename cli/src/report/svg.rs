//! One SVG chart per family: a horizontal bar per (case, thread count) at its median, with a
//! whisker from min to max over the rounds. A logarithmic axis when the values span more than
//! a factor of 20 (system call against a load), a linear one from zero otherwise.
//!
//! Text is left to the viewer's sans-serif font: no font files are read or embedded.

use crate::bench::{Family, Measured, RunInfo};
use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::report::table::fmt_num;
use std::io::Write;
use std::path::Path;
use svg::Document;
use svg::node::element::{Group, Line, Rectangle, Text, Title};

const WIDTH: f64 = 860.0;
const LABEL_RIGHT: f64 = 200.0;
const PLOT_LEFT: f64 = 212.0;
const PLOT_RIGHT: f64 = 760.0;
const TOP: f64 = 74.0;
const ROW: f64 = 26.0;
const BAR: f64 = 14.0;
const BOTTOM: f64 = 58.0;
const FONT: &str = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif";
const BAR_COLOUR: &str = "#4c78a8";
const BASELINE_COLOUR: &str = "#f58518";
const INK: &str = "#222";
const GRID: &str = "#ddd";

/// How values map to the horizontal axis.
enum Scale {
    /// Decades `10^low .. 10^high`.
    Log { low: i32, high: i32 },
    /// `0 .. max` with ticks every `step`.
    Linear { max: f64, step: f64 },
}

impl Scale {
    fn fit(values: impl Iterator<Item = f64> + Clone) -> Scale {
        let max = values.clone().fold(0.0_f64, f64::max);
        let min_positive = values.filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
        if max > 0.0 && min_positive.is_finite() && max / min_positive > 20.0 {
            let low = min_positive.log10().floor() as i32;
            let high = (max.log10().ceil() as i32).max(low + 1);
            return Scale::Log { low, high };
        }
        let max = if max > 0.0 { max } else { 1.0 };
        let rough = max / 5.0;
        let power = 10f64.powf(rough.log10().floor());
        let step = [1.0, 2.0, 2.5, 5.0, 10.0]
            .iter()
            .map(|m| m * power)
            .find(|s| *s >= rough)
            .unwrap_or(power * 10.0);
        Scale::Linear {
            max: (max / step).ceil() * step,
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
                    (value.log10() - f64::from(low)) / f64::from(high - low)
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
            Scale::Log { low, high } => (low..=high).map(|p| 10f64.powi(p)).collect(),
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

/// The chart of one family's results.
pub fn chart(
    family: &Family,
    results: &[&Measured],
    machine: &Machine,
    info: &RunInfo,
) -> Document {
    let several_threads = results.iter().any(|m| m.threads != results[0].threads);
    let unit = results.first().map_or("", |m| m.unit.label());
    let stats: Vec<_> = results.iter().map(|m| m.stats()).collect();
    let scale = Scale::fit(stats.iter().flat_map(|s| [s.min, s.max]));
    let plot_bottom = TOP + ROW * results.len() as f64;
    let height = plot_bottom + BOTTOM;

    let mut document = Document::new()
        .set("width", WIDTH)
        .set("height", height)
        .set("viewBox", (0, 0, WIDTH, height))
        .add(
            Rectangle::new()
                .set("width", "100%")
                .set("height", "100%")
                .set("fill", "white"),
        )
        .add(Title::new(format!("thiscpu bench {}", family.name)))
        .add(
            text(16.0, 26.0, format!("{} — {}", family.name, family.about))
                .set("font-size", 16)
                .set("font-weight", "bold"),
        )
        .add(text(16.0, 46.0, machine.summary()).set("fill", "#555"))
        .add(
            text(
                16.0,
                62.0,
                format!(
                    "{}; current_cpu() from {}",
                    machine.rseq.summary(),
                    machine.cpu_source
                ),
            )
            .set("fill", "#555"),
        );

    let mut grid = Group::new();
    for tick in scale.ticks() {
        let x = scale.x(tick);
        grid = grid
            .add(line(x, TOP - 4.0, x, plot_bottom, GRID, 1.0))
            .add(text(x, plot_bottom + 16.0, tick_label(tick)).set("text-anchor", "middle"));
    }
    grid = grid.add(line(
        PLOT_LEFT,
        TOP - 4.0,
        PLOT_LEFT,
        plot_bottom,
        "#999",
        1.0,
    ));
    document = document.add(grid).add(
        text(
            (PLOT_LEFT + PLOT_RIGHT) / 2.0,
            plot_bottom + 36.0,
            format!(
                "{unit} ({}) · bar: median · whisker: min–max over {} rounds",
                scale.name(),
                info.rounds
            ),
        )
        .set("text-anchor", "middle"),
    );

    for (i, (m, s)) in results.iter().zip(&stats).enumerate() {
        let centre = TOP + ROW * i as f64 + ROW / 2.0;
        let label = if several_threads {
            format!("{} ×{}", m.case, m.threads)
        } else {
            m.case.to_owned()
        };
        let colour = if family.baseline == Some(m.case) {
            BASELINE_COLOUR
        } else {
            BAR_COLOUR
        };
        let (x_min, x_median, x_max) = (scale.x(s.min), scale.x(s.median), scale.x(s.max));
        let row = Group::new()
            .add(Title::new(format!(
                "{label}: median {} {unit}, min {}, max {}, {} rounds; {}",
                fmt_num(s.median),
                fmt_num(s.min),
                fmt_num(s.max),
                m.rounds.len(),
                m.how
            )))
            .add(text(LABEL_RIGHT, centre + 4.0, label).set("text-anchor", "end"))
            .add(
                Rectangle::new()
                    .set("x", PLOT_LEFT)
                    .set("y", round(centre - BAR / 2.0))
                    .set("width", round((x_median - PLOT_LEFT).max(1.0)))
                    .set("height", BAR)
                    .set("fill", colour),
            )
            .add(line(x_min, centre, x_max, centre, INK, 1.2))
            .add(line(x_min, centre - 4.0, x_min, centre + 4.0, INK, 1.2))
            .add(line(x_max, centre - 4.0, x_max, centre + 4.0, INK, 1.2))
            .add(text(
                x_max.max(x_median) + 6.0,
                centre + 4.0,
                fmt_num(s.median),
            ));
        document = document.add(row);
    }
    document
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
        let log = Scale::fit([0.3, 0.35, 180.0, 190.0].into_iter());
        assert!(matches!(log, Scale::Log { low: -1, high: 3 }));
        assert_eq!(log.fraction(1.0), 0.25);
        let linear = Scale::fit([20.0, 23.0, 24.6].into_iter());
        assert!(matches!(linear, Scale::Linear { .. }));
        assert_eq!(linear.ticks().last().copied(), Some(25.0));
    }
}
