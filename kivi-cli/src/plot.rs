//! A hand-written SVG chart: time per call of each variant against the
//! context length, one panel per batch size, log-log axes. Light (no
//! dependency) and readable in any browser.

use kivi_tuner::decisions::Entry;
use std::collections::BTreeMap;
use std::fmt::Write;

/// At most this many variants get their own line (the chosen ones and the
/// default always do); the rest would be noise.
pub const MAX_LINES: usize = 8;

const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Renders the entries of one scheme as SVG text.
pub fn svg(title: &str, entries: &[&Entry]) -> String {
    // batch -> variant -> [(context, median seconds)]
    let mut panels: BTreeMap<u32, BTreeMap<String, Vec<(u32, f64)>>> = BTreeMap::new();
    let mut important: Vec<String> = Vec::new();
    for e in entries {
        for name in [&e.default, &e.chosen] {
            if !important.contains(name) {
                important.push(name.clone());
            }
        }
        for c in &e.candidates {
            if let (true, Some(t)) = (c.status.timed(), c.timing) {
                panels
                    .entry(e.bucket.batch)
                    .or_default()
                    .entry(c.name.clone())
                    .or_default()
                    .push((e.bucket.context, t.median_s));
            }
        }
    }
    // Lines: the important ones, then the fastest others by best rank.
    let mut score: BTreeMap<String, f64> = BTreeMap::new();
    for p in panels.values() {
        for (name, pts) in p {
            let s: f64 = pts.iter().map(|(_, t)| t.ln()).sum::<f64>() / pts.len().max(1) as f64;
            score.entry(name.clone()).and_modify(|x| *x = x.min(s)).or_insert(s);
        }
    }
    let mut others: Vec<(String, f64)> = score.into_iter().filter(|(n, _)| !important.contains(n)).collect();
    others.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut lines = important.clone();
    for (n, _) in others {
        if lines.len() >= MAX_LINES.max(important.len()) {
            break;
        }
        lines.push(n);
    }

    let (pw, ph, ml, mt, mb, gap) = (460.0, 300.0, 70.0, 50.0, 50.0, 40.0);
    let legend_h = 18.0 * lines.len() as f64 + 20.0;
    let width = ml + panels.len().max(1) as f64 * (pw + gap) + 10.0;
    let height = mt + ph + mb + legend_h;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(o, r#"<text x="{ml}" y="24" font-size="15">{}</text>"#, esc(title));
    if panels.is_empty() {
        let _ = writeln!(o, r#"<text x="{ml}" y="{}">no timings to plot</text>"#, mt + 20.0);
    }
    for (pi, (batch, series)) in panels.iter().enumerate() {
        let x0 = ml + pi as f64 * (pw + gap);
        let pts: Vec<(u32, f64)> = series
            .iter()
            .filter(|(n, _)| lines.contains(n))
            .flat_map(|(_, p)| p.iter().copied())
            .collect();
        let (cmin, cmax) = pts.iter().fold((u32::MAX, 0), |(a, b), (c, _)| (a.min(*c), b.max(*c)));
        let (tmin, tmax) = pts
            .iter()
            .fold((f64::INFINITY, 0f64), |(a, b), (_, t)| (a.min(*t), b.max(*t)));
        let (lc0, lc1) = ((cmin.max(1) as f64).log2() - 0.3, (cmax.max(1) as f64).log2() + 0.3);
        let (lt0, lt1) = (tmin.log10() - 0.1, tmax.log10() + 0.1);
        let sx = |c: u32| x0 + ((c as f64).log2() - lc0) / (lc1 - lc0).max(1e-9) * pw;
        let sy = |t: f64| mt + ph - (t.log10() - lt0) / (lt1 - lt0).max(1e-9) * ph;
        let _ = writeln!(
            o,
            r##"<rect x="{x0}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">batch {batch}</text>"#,
            x0 + pw / 2.0,
            mt - 8.0
        );
        // Context ticks: every bucket context present.
        let mut ctxs: Vec<u32> = pts.iter().map(|p| p.0).collect();
        ctxs.sort();
        ctxs.dedup();
        for c in ctxs {
            let x = sx(c);
            let label = if c >= 1024 {
                format!("{}k", c / 1024)
            } else {
                c.to_string()
            };
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##,
                mt,
                mt + ph
            );
            let _ = writeln!(
                o,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{label}</text>"#,
                mt + ph + 16.0
            );
        }
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">context length (tokens)</text>"#,
            x0 + pw / 2.0,
            mt + ph + 34.0
        );
        // Time ticks at decades and halves.
        if lt1 > lt0 {
            let mut e = lt0.floor();
            while e <= lt1.ceil() {
                for m in [1.0, 2.0, 5.0] {
                    let t = m * 10f64.powf(e);
                    if t.log10() < lt0 || t.log10() > lt1 {
                        continue;
                    }
                    let y = sy(t);
                    let label = if t >= 1e-3 {
                        format!("{} ms", t * 1e3)
                    } else {
                        format!("{} us", (t * 1e6 * 1000.0).round() / 1000.0)
                    };
                    let _ = writeln!(
                        o,
                        r##"<line x1="{x0}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/>"##,
                        x0 + pw
                    );
                    let _ = writeln!(
                        o,
                        r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                        x0 - 4.0,
                        y + 4.0,
                        esc(&label)
                    );
                }
                e += 1.0;
            }
        }
        for (li, name) in lines.iter().enumerate() {
            let Some(p) = series.get(name) else { continue };
            let mut p = p.clone();
            p.sort_by_key(|x| x.0);
            let color = PALETTE[li % PALETTE.len()];
            let dash = if li == 0 { r#" stroke-dasharray="6 3""# } else { "" };
            let path: Vec<String> = p.iter().map(|(c, t)| format!("{:.1},{:.1}", sx(*c), sy(*t))).collect();
            let _ = writeln!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
                path.join(" ")
            );
            for (c, t) in &p {
                let _ = writeln!(
                    o,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{} @ {c}: {:.3} ms</title></circle>"#,
                    sx(*c),
                    sy(*t),
                    esc(name),
                    t * 1e3
                );
            }
        }
    }
    let ly = mt + ph + mb + 10.0;
    for (li, name) in lines.iter().enumerate() {
        let color = PALETTE[li % PALETTE.len()];
        let y = ly + 18.0 * li as f64;
        let mut tag = String::new();
        if li == 0 {
            tag.push_str(" (default, dashed)");
        }
        let chosen_in: Vec<String> = entries
            .iter()
            .filter(|e| &e.chosen == name)
            .map(|e| e.bucket.key())
            .collect();
        if !chosen_in.is_empty() {
            tag.push_str(&format!(" chosen for {}", chosen_in.join(", ")));
        }
        let _ = writeln!(
            o,
            r#"<rect x="{ml}" y="{:.1}" width="14" height="4" fill="{color}"/>"#,
            y - 4.0
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{y:.1}">{}{}</text>"#,
            ml + 20.0,
            esc(name),
            esc(&tag)
        );
    }
    o.push_str("</svg>\n");
    o
}
