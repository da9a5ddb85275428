//! `--plot out.svg`: bus bandwidth against message size, one line per
//! (run, op), so several backends or runs share one picture.

use super::report::Row;
use anyhow::{Context, Result};
use plotters::prelude::*;

pub fn svg(path: &str, runs: &[(String, Vec<Row>)]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .flat_map(|(label, rows)| {
            let mut ops: Vec<&str> = rows.iter().map(|r| r.op.as_str()).filter(|o| *o != "barrier").collect();
            ops.dedup();
            ops.into_iter().map(move |op| {
                let pts = rows.iter().filter(|r| r.op == op).map(|r| (r.bytes as f64, r.busbw)).collect();
                (format!("{label} {op}"), pts)
            })
        })
        .collect();
    let xs = series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let (xmin, xmax) = xs.fold((f64::MAX, 1.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let ymax = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(0.0f64, f64::max).max(1e-3) * 1.1;
    let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("weft bench: bus bandwidth", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin.min(8.0)..xmax * 1.5).log_scale(), 0.0..ymax)?;
    chart.configure_mesh().x_desc("message size (bytes)").y_desc("busbw (GB/s)").draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present().with_context(|| format!("writing {path}"))?;
    Ok(())
}
