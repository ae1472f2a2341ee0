//! The conformance table of docs/policies/two-tier-cost-fn.md, row by row.

use super::*;

struct Case {
    params: &'static str,
    target: Option<u64>,
    rows: [(u64, f64, f64, u64); 2],
    picks: u64,
    why: &'static str,
}

#[rustfmt::skip]
const CONFORMANCE: &[Case] = &[
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: B, why: "0.6 > 0.5" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 5.0, 0.0, 4)], picks: A, why: "0.5 is not > 0.5" },
    Case { params: r#"{"cache_threshold": 0.2}"#, target: None, rows: [(A, 0.0, 0.0, 0), (B, 3.0, 0.0, 4)], picks: B, why: "0.3 > 0.2" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 10.0, 0.0, 40)], picks: A, why: "load tier" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 640), (B, 10.0, 0.0, 704)], picks: B, why: "704 is not > 1.1*640" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 640), (B, 10.0, 0.0, 705)], picks: A, why: "705 > 1.1*640" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 0.0, 8.0, 4)], picks: B, why: "8*0.75 = 6 -> 0.6" },
    Case { params: r#"{"host_cache_weight": 0}"#, target: None, rows: [(A, 0.0, 0.0, 0), (B, 0.0, 8.0, 4)], picks: A, why: "host tier ignored" },
    Case { params: DEFAULTS, target: Some(A), rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: B, why: "target ignored by default" },
    Case { params: RESPECT, target: Some(A), rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: A, why: "target respected" },
    Case { params: RESPECT, target: Some(999), rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: B, why: "fallback" },
    Case { params: RESPECT, target: Some(A), rows: [(A, 0.0, 0.0, 40), (B, 0.0, 0.0, 2)], picks: A, why: "no gate: overloaded target kept" },
    Case { params: RESPECT_GATE, target: Some(A), rows: [(A, 0.0, 0.0, 40), (B, 0.0, 0.0, 2)], picks: B, why: "released" },
    Case { params: RESPECT_GATE, target: Some(A), rows: [(A, 0.0, 0.0, 30), (B, 0.0, 0.0, 2)], picks: A, why: "gap 28 is not > 32" },
];

#[test]
fn conformance_table_of_the_design() {
    for (n, case) in CONFORMANCE.iter().enumerate() {
        // The design's table is the seed's behaviour: Dynamo's `active_requests` signal (and, in
        // RESPECT and RESPECT_GATE, no cache gate on a soft target).
        let params = match case.params {
            DEFAULTS => ACTIVE.to_string(),
            p => p.replacen('{', r#"{"load_signal": "active_requests", "#, 1),
        };
        let policy = policy(&params);
        let request = match case.target {
            Some(worker) => request().target(worker, None),
            None => request(),
        };
        let rows: Vec<TestRow> = case
            .rows
            .iter()
            .map(|&(w, device, host, active)| row(w, device, host, active))
            .collect();
        let mut reversed = rows.clone();
        reversed.reverse();
        for rows in [rows, reversed] {
            assert_eq!(
                picked(&policy, &rows, &request),
                at(case.picks, 0),
                "case {n} ({}, {})",
                case.params,
                case.why
            );
        }
    }
}
