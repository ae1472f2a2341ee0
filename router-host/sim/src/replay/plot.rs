//! `--plot`: one self-contained SVG comparing the configs.
//!
//! Top left: measured hit rate per config, with the workload's ideal bound as a dashed line and
//! the pooled-LRU reference (when the configs share engines) as a dotted one.
//! Top right: TTFT p50 / p90 / p99 per config. Below: one panel per config with the requests on
//! each worker over simulated time (one line per worker, same scales in every panel).

use std::fmt::Write as _;

use super::report::{column_names, Report};

const WIDTH: f64 = 1000.0;
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// A "nice" axis maximum >= `x` whose quarters are round numbers.
fn nice(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return 1.0;
    }
    if x <= 4.0 {
        return 4.0;
    }
    let p = 10f64.powf(x.log10().floor());
    for m in [1.0, 1.2, 1.6, 2.0, 2.4, 3.2, 4.0, 6.0, 8.0] {
        if m * p >= x {
            return m * p;
        }
    }
    10.0 * p
}

struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

impl Panel {
    fn frame(&self, s: &mut String, title: &str, y_max: f64, y_fmt: &dyn Fn(f64) -> String) {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="13" font-weight="bold">{}</text>"#,
            self.x,
            self.y - 8.0,
            esc(title)
        );
        for k in 0..=4 {
            let v = y_max * f64::from(k) / 4.0;
            let y = self.y + self.h - self.h * f64::from(k) / 4.0;
            let _ = writeln!(
                s,
                "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\">{}</text>",
                self.x,
                self.x + self.w,
                self.x - 4.0,
                y + 3.0,
                y_fmt(v)
            );
        }
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#888\"/>",
            self.x, self.y, self.w, self.h
        );
    }
}

/// Render the report as SVG text.
pub fn svg(report: &Report) -> String {
    let names = column_names(&report.configs);
    let n = report.configs.len().max(1);
    let load_rows = n.div_ceil(2);
    let height = 60.0 + 300.0 + load_rows as f64 * 250.0 + 20.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let w = &report.workload;
    let _ = writeln!(
        s,
        r#"<text x="20" y="24" font-size="15" font-weight="bold">router-host replay: {} requests, {} workers x {} ranks</text>"#,
        w.requests, report.cluster.workers, report.cluster.dp_size
    );
    let _ = writeln!(
        s,
        r##"<text x="20" y="42" font-size="11" fill="#555">{}</text>"##,
        esc(&w.source)
    );

    // Hit rate.
    let hit = Panel {
        x: 60.0,
        y: 80.0,
        w: 400.0,
        h: 220.0,
    };
    // The pooled-LRU reference, when every config has the same one (the same engines).
    let reference = report
        .configs
        .first()
        .map(|c| c.pooled_lru_reference.hit_rate)
        .filter(|&r| {
            report
                .configs
                .iter()
                .all(|c| c.pooled_lru_reference.hit_rate == r)
        });
    hit.frame(
        &mut s,
        if reference.is_some() {
            "prefix-cache hit rate (dashed: ideal bound; dotted: pooled-LRU reference)"
        } else {
            "prefix-cache hit rate (dashed: ideal bound)"
        },
        1.0,
        &|v| format!("{v:.2}"),
    );
    let slot = hit.w / n as f64;
    for (i, c) in report.configs.iter().enumerate() {
        let bh = hit.h * c.hit_rate.clamp(0.0, 1.0);
        let x = hit.x + slot * i as f64 + slot * 0.2;
        let _ = writeln!(
            s,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{:.3}</text>",
            hit.y + hit.h - bh,
            slot * 0.6,
            color(i),
            x + slot * 0.3,
            hit.y + hit.h - bh - 3.0,
            c.hit_rate
        );
        label(&mut s, &names[i], x + slot * 0.3, hit.y + hit.h + 14.0);
    }
    let ideal_y = hit.y + hit.h * (1.0 - w.ideal_hit_rate.clamp(0.0, 1.0));
    let _ = writeln!(
        s,
        "<line x1=\"{:.1}\" y1=\"{ideal_y:.1}\" x2=\"{:.1}\" y2=\"{ideal_y:.1}\" stroke=\"#000\" stroke-dasharray=\"6 4\"/>",
        hit.x,
        hit.x + hit.w
    );
    if let Some(r) = reference {
        let y = hit.y + hit.h * (1.0 - r.clamp(0.0, 1.0));
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#000\" stroke-dasharray=\"1 3\"/>",
            hit.x,
            hit.x + hit.w
        );
    }

    // TTFT percentiles.
    let ttft = Panel {
        x: 560.0,
        y: 80.0,
        w: 420.0,
        h: 220.0,
    };
    let t_max = nice(
        report
            .configs
            .iter()
            .map(|c| c.ttft_ms.p99)
            .fold(0.0, f64::max),
    );
    ttft.frame(
        &mut s,
        "TTFT ms: p50 / p90 / p99 (darkest to lightest)",
        t_max,
        &|v| format!("{v:.0}"),
    );
    let slot = ttft.w / n as f64;
    for (i, c) in report.configs.iter().enumerate() {
        let bw = slot * 0.8 / 3.0;
        for (k, (v, shade)) in [
            (c.ttft_ms.p50, 1.0),
            (c.ttft_ms.p90, 0.7),
            (c.ttft_ms.p99, 0.45),
        ]
        .into_iter()
        .enumerate()
        {
            let bh = ttft.h * (v / t_max).clamp(0.0, 1.0);
            let x = ttft.x + slot * i as f64 + slot * 0.1 + bw * k as f64;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\" fill-opacity=\"{shade}\"><title>{} p{}: {v:.1} ms</title></rect>",
                ttft.y + ttft.h - bh,
                bw * 0.95,
                color(i),
                esc(&names[i]),
                [50, 90, 99][k]
            );
        }
        label(
            &mut s,
            &names[i],
            ttft.x + slot * (i as f64 + 0.5),
            ttft.y + ttft.h + 14.0,
        );
    }

    // Load per worker over time, one panel per config.
    let y_max = nice(
        report
            .configs
            .iter()
            .flat_map(|c| c.load_over_time.active_requests.iter().flatten())
            .copied()
            .max()
            .unwrap_or(1) as f64,
    );
    let samples = report
        .configs
        .iter()
        .map(|c| c.load_over_time.active_requests.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let workers = report.cluster.workers as usize;
    let mut legend = String::new();
    for wkr in 0..workers.min(16) {
        let x = 60.0 + wkr as f64 * 58.0;
        let _ = write!(
            legend,
            "<line x1=\"{x:.1}\" y1=\"336\" x2=\"{:.1}\" y2=\"336\" stroke=\"{}\" stroke-width=\"3\"/><text x=\"{:.1}\" y=\"340\" font-size=\"10\">w{wkr}</text>",
            x + 14.0,
            color(wkr),
            x + 17.0
        );
    }
    if workers > 16 {
        let _ = write!(
            legend,
            "<text x=\"{:.1}\" y=\"340\" font-size=\"10\">... {workers} workers; colours repeat every {}</text>",
            60.0 + 16.0 * 58.0,
            PALETTE.len()
        );
    }
    let _ = writeln!(s, "{legend}");
    for (i, c) in report.configs.iter().enumerate() {
        let panel = Panel {
            x: if i % 2 == 0 { 60.0 } else { 560.0 },
            y: 380.0 + (i / 2) as f64 * 250.0,
            w: 420.0,
            h: 190.0,
        };
        panel.frame(
            &mut s,
            &format!("{}: requests on each worker over time", names[i]),
            y_max,
            &|v| format!("{v:.0}"),
        );
        let t = &c.load_over_time;
        let workers = t.active_requests.first().map_or(0, Vec::len);
        for wkr in 0..workers {
            let mut points = String::new();
            for (k, sample) in t.active_requests.iter().enumerate() {
                let x = panel.x + panel.w * k as f64 / (samples - 1) as f64;
                let y = panel.y + panel.h - panel.h * (f64::from(sample[wkr]) / y_max).min(1.0);
                let _ = write!(points, "{x:.1},{y:.1} ");
            }
            let _ = writeln!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1\" stroke-opacity=\"0.8\"><title>worker {wkr}</title></polyline>",
                points.trim_end(),
                color(wkr)
            );
        }
        let span = t.interval_s * (samples - 1) as f64;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\">0 s</text><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\">{span:.0} s</text>",
            panel.x,
            panel.y + panel.h + 12.0,
            panel.x + panel.w,
            panel.y + panel.h + 12.0
        );
    }
    s.push_str("</svg>\n");
    s
}

fn label(s: &mut String, text: &str, x: f64, y: f64) {
    let shown: String = if text.chars().count() > 18 {
        text.chars().take(17).chain(['…']).collect()
    } else {
        text.to_string()
    };
    let _ = writeln!(
        s,
        r#"<text x="{x:.1}" y="{y:.1}" font-size="10" text-anchor="middle">{}</text>"#,
        esc(&shown)
    );
}
