//! Results: the nccl-tests-style table, CSV, JSON, and reading JSON back.

use std::fmt::Write as _;

/// One measured (op, size).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub backend: String,
    pub world: usize,
    pub op: String,
    pub bytes: usize,
    pub count: usize,
    pub dtype: String,
    pub redop: String,
    pub root: String,
    pub iters: usize,
    /// Per-iteration times (max over ranks), microseconds.
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub p99_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    pub wrong: u64,
}

/// Column headers, shared by the table and CSV.
const COLS: [&str; 14] = [
    "size(B)",
    "count",
    "type",
    "redop",
    "root",
    "iters",
    "time(us)",
    "min(us)",
    "max(us)",
    "p99(us)",
    "algbw(GB/s)",
    "busbw(GB/s)",
    "#wrong",
    "op",
];

pub fn table_header() -> String {
    format!(
        "{:>12} {:>10} {:>5} {:>8} {:>4} {:>5} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11} {:>6}  {}",
        COLS[0], COLS[1], COLS[2], COLS[3], COLS[4], COLS[5], COLS[6], COLS[7], COLS[8], COLS[9], COLS[10], COLS[11], COLS[12], COLS[13]
    )
}

pub fn table_row(r: &Row) -> String {
    format!(
        "{:>12} {:>10} {:>5} {:>8} {:>4} {:>5} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>11.3} {:>11.3} {:>6}  {}",
        r.bytes, r.count, r.dtype, r.redop, r.root, r.iters, r.median_us, r.min_us, r.max_us, r.p99_us, r.algbw, r.busbw, r.wrong, r.op
    )
}

pub fn csv(rows: &[Row]) -> String {
    let mut s =
        String::from("backend,world,op,bytes,count,dtype,redop,root,iters,median_us,min_us,max_us,p99_us,algbw_gbps,busbw_gbps,wrong\n");
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.6},{:.6},{}",
            r.backend,
            r.world,
            r.op,
            r.bytes,
            r.count,
            r.dtype,
            r.redop,
            r.root,
            r.iters,
            r.median_us,
            r.min_us,
            r.max_us,
            r.p99_us,
            r.algbw,
            r.busbw,
            r.wrong
        );
    }
    s
}

pub fn json(rows: &[Row]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"backend\":{:?},\"world\":{},\"op\":{:?},\"bytes\":{},\"count\":{},\"dtype\":{:?},\"redop\":{:?},\"root\":{:?},\"iters\":{},\"median_us\":{:.3},\"min_us\":{:.3},\"max_us\":{:.3},\"p99_us\":{:.3},\"algbw_gbps\":{:.6},\"busbw_gbps\":{:.6},\"wrong\":{}}}",
                r.backend, r.world, r.op, r.bytes, r.count, r.dtype, r.redop, r.root, r.iters, r.median_us, r.min_us, r.max_us, r.p99_us, r.algbw, r.busbw, r.wrong
            )
        })
        .collect();
    format!("[\n  {}\n]\n", items.join(",\n  "))
}

/// Read rows back from `json` output (for plotting earlier runs).
pub fn from_json(text: &str) -> anyhow::Result<Vec<Row>> {
    let v: serde_json::Value = serde_json::from_str(text)?;
    let arr = v.as_array().ok_or_else(|| anyhow::anyhow!("expected a JSON array of rows"))?;
    arr.iter()
        .map(|o| {
            let s = |k: &str| o[k].as_str().map(str::to_string).ok_or_else(|| anyhow::anyhow!("row lacks string {k}"));
            let n = |k: &str| o[k].as_f64().ok_or_else(|| anyhow::anyhow!("row lacks number {k}"));
            Ok(Row {
                backend: s("backend")?,
                world: n("world")? as usize,
                op: s("op")?,
                bytes: n("bytes")? as usize,
                count: n("count")? as usize,
                dtype: s("dtype")?,
                redop: s("redop")?,
                root: s("root")?,
                iters: n("iters")? as usize,
                median_us: n("median_us")?,
                min_us: n("min_us")?,
                max_us: n("max_us")?,
                p99_us: n("p99_us")?,
                algbw: n("algbw_gbps")?,
                busbw: n("busbw_gbps")?,
                wrong: n("wrong")? as u64,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips() {
        let r = Row {
            backend: "cpu-tcp".into(),
            world: 2,
            op: "all_reduce".into(),
            bytes: 8,
            count: 2,
            dtype: "f32".into(),
            redop: "sum".into(),
            root: "-".into(),
            iters: 20,
            median_us: 12.5,
            min_us: 10.0,
            max_us: 20.0,
            p99_us: 19.0,
            algbw: 0.001,
            busbw: 0.001,
            wrong: 0,
        };
        assert_eq!(from_json(&json(std::slice::from_ref(&r))).unwrap(), vec![r]);
    }
}
