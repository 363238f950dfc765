//! `--plot`: a PNG with the TTFT CDF of every run and, one panel per run, every engine's KV usage over time.
//!
//! Text is drawn with ab_glyph from a TrueType font found on the system (DejaVu or Liberation
//! Sans); when none is found the charts are drawn without text.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::report::SimReport;

const WIDTH: u32 = 1400;
const CDF_HEIGHT: u32 = 520;
const KV_PANEL_HEIGHT: u32 = 300;
/// Runs shown as KV panels (the CDF shows every run).
const MAX_KV_PANELS: usize = 8;
const MAX_POINTS: usize = 2000;

const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a system font for plotters' "sans-serif" once; whether one was found.
fn fonts_available() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        FONT_PATHS.iter().any(|path| match std::fs::read(path) {
            Ok(bytes) => {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            }
            Err(_) => false,
        })
    })
}

fn color(index: usize) -> RGBColor {
    const COLORS: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    COLORS[index % COLORS.len()]
}

fn err<E: std::fmt::Debug>(error: E) -> String {
    format!("{error:?}")
}

/// Draws the report's charts into a PNG at `path`.
pub fn draw(report: &SimReport, path: &Path) -> Result<(), String> {
    draw_with(report, path, fonts_available())
}

pub(crate) fn draw_with(report: &SimReport, path: &Path, text: bool) -> Result<(), String> {
    let panels = report.runs.len().min(MAX_KV_PANELS);
    let height = CDF_HEIGHT + KV_PANEL_HEIGHT * panels as u32;
    let root = BitMapBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, rest) = root.split_vertically(CDF_HEIGHT);
    draw_cdf(report, &top, text)?;
    let mut area = rest;
    for (index, run) in report.runs.iter().take(panels).enumerate() {
        let (panel, below) = area.split_vertically(KV_PANEL_HEIGHT);
        draw_kv(&run.label, &run.kv_series, report.setup.workers, index, &panel, text)?;
        area = below;
    }
    root.present().map_err(err)
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn draw_cdf(report: &SimReport, area: &Area<'_>, text: bool) -> Result<(), String> {
    let all = report.runs.iter().flat_map(|run| run.ttft_ms_sorted.iter().copied());
    let lo = all.clone().fold(f64::INFINITY, f64::min).max(0.1);
    let hi = all.fold(0.0, f64::max).max(lo * 10.0);
    let (lo, hi) = if lo.is_finite() { (lo * 0.9, hi * 1.1) } else { (1.0, 10.0) };
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder
            .caption("TTFT CDF per policy (virtual time)", ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(55);
    }
    let mut chart = builder.build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0).map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("TTFT (ms, log scale)").y_desc("fraction of requests");
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(err)?;
    for (index, run) in report.runs.iter().enumerate() {
        let values = &run.ttft_ms_sorted;
        let n = values.len();
        let step = (n / MAX_POINTS).max(1);
        let points = (0..n)
            .step_by(step)
            .chain((n > 0).then_some(n - 1))
            .map(|i| (values[i].max(lo), (i + 1) as f64 / n as f64));
        let style = ShapeStyle::from(color(index)).stroke_width(2);
        let series = chart.draw_series(LineSeries::new(points, style)).map_err(err)?;
        if text {
            series
                .label(run.label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

fn draw_kv(
    label: &str,
    series: &[(f64, Vec<f64>)],
    workers: usize,
    _run_index: usize,
    area: &Area<'_>,
    text: bool,
) -> Result<(), String> {
    let end = series.last().map_or(1.0, |(t, _)| t.max(1.0));
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder
            .caption(format!("KV usage per engine over time: {label}"), ("sans-serif", 16))
            .x_label_area_size(30)
            .y_label_area_size(55);
    }
    let mut chart = builder.build_cartesian_2d(0.0..end, 0.0..1.0).map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("virtual time (s)").y_desc("token_usage");
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(err)?;
    let step = (series.len() / MAX_POINTS).max(1);
    for worker in 0..workers {
        let points = series.iter().step_by(step).filter_map(|(t, usage)| usage.get(worker).map(|&u| (*t, u)));
        chart
            .draw_series(LineSeries::new(points, ShapeStyle::from(color(worker)).stroke_width(1)))
            .map_err(err)?;
    }
    Ok(())
}
