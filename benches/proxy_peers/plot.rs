//! The plot of one `proxy_peers` run: requests/s and p50 against
//! concurrency, one line per configuration (SVG, `plotters`).

use std::path::Path;

use plotters::prelude::*;

use super::Cells;

/// One configuration's points: concurrency, requests/s, p50 in µs.
type Points = Vec<(f64, f64, f64)>;

/// Writes the SVG to `path`: requests/s on the left, p50 (log scale) on
/// the right, concurrency (log scale) along both.
pub fn write(
    path: &Path,
    names: &[&str],
    concurrencies: &[usize],
    cells: &Cells,
) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    let series: Vec<(&str, Points)> = names
        .iter()
        .map(|&name| {
            let points = cells
                .iter()
                .filter(|(_, n, _)| *n == name)
                .filter_map(|(c, _, s)| {
                    let s = s.as_ref().ok()?;
                    Some((*c as f64, s.rps, s.p50.as_secs_f64() * 1e6))
                })
                .collect();
            (name, points)
        })
        .filter(|(_, points): &(&str, Points)| !points.is_empty())
        .collect();
    let max_rps = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    let (min_p50, max_p50) = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.2))
        .fold((f64::MAX, 1.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let x_max = concurrencies.iter().copied().max().unwrap_or(256) as f64 * 1.3;
    let root = SVGBackend::new(path, (1400, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(
            "idempotency-proxy, nginx and idempotent-proxy-server (wrk, 1 KiB JSON POST)",
            ("sans-serif", 20),
        )
        .map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(700);
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();

    let mut chart = ChartBuilder::on(&left)
        .caption("requests/s", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d((0.8f64..x_max).log_scale(), 0f64..max_rps * 1.1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("concurrent connections")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{:.0}k", y / 1000.0))
        .draw()
        .map_err(err)?;
    for (index, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.0, p.1)),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
        chart
            .draw_series(
                points
                    .iter()
                    .map(|p| Circle::new((p.0, p.1), 3, color.filled())),
            )
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(err)?;

    let mut chart = ChartBuilder::on(&right)
        .caption("p50 latency (µs, log scale)", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (0.8f64..x_max).log_scale(),
            (min_p50.min(max_p50) * 0.8..max_p50 * 1.25).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("concurrent connections")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    for (index, (_, points)) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.0, p.2)),
                color.stroke_width(2),
            ))
            .map_err(err)?;
        chart
            .draw_series(
                points
                    .iter()
                    .map(|p| Circle::new((p.0, p.2), 3, color.filled())),
            )
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
