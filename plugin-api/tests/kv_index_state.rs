//! The 1.4 `kv_index_state` column as a policy reads it through the safe layer.

use plugin_api::testing::{TestRequest, TestRow, TestRows};
use plugin_api::{Context, Explanation, Inputs, KvIndexState, PickError, Policy, Rows};

/// Records what it saw: each row's state and trusted device overlap.
struct Probe;

impl Policy for Probe {
    fn inputs(&self) -> Inputs {
        Inputs::CACHE
    }

    fn pick(&self, _: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        let trust = rows.kv_index_trust();
        let overlap = rows.overlap().ok_or_else(|| PickError::new("no overlap"))?;
        // The row with the most trusted device overlap.
        (0..rows.len())
            .max_by(|&a, &b| {
                trust
                    .overlap(a, overlap.device[a])
                    .total_cmp(&trust.overlap(b, overlap.device[b]))
            })
            .ok_or_else(|| PickError::new("no rows"))
    }

    fn explain(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<Explanation> {
        let i = self.pick(ctx, rows).ok()?;
        Some(
            rows.kv_index_trust()
                .explain(rows, Explanation::new(i, "most_cached")),
        )
    }
}

fn rows() -> TestRows {
    TestRows::new(vec![
        TestRow::new(1, 0).device(8.0),
        TestRow::new(2, 0).device(2.0),
        TestRow::new(3, 0),
    ])
}

#[test]
fn codes_round_trip_and_anything_else_is_unknown() {
    for state in KvIndexState::ALL {
        assert_eq!(KvIndexState::from_code(state.code()), state);
        assert_eq!(KvIndexState::from_u8(state as u8), state);
    }
    for odd in [f64::NAN, -1.0, 0.5, 4.0, 255.0, f64::INFINITY] {
        assert_eq!(KvIndexState::from_code(odd), KvIndexState::Unknown, "{odd}");
    }
    assert_eq!(KvIndexState::from_u8(9), KvIndexState::Unknown);
    assert_eq!(
        KvIndexState::ALL.map(KvIndexState::as_str),
        ["current", "unknown", "stale", "lagging"]
    );
}

#[test]
fn without_the_column_every_row_is_current_as_from_older_hosts() {
    let request = TestRequest::new(64, 16);
    assert_eq!(rows().pick_worker(&Probe, &request).unwrap().worker_id, 1);
    let why = rows().explain(&Probe, &request).unwrap();
    assert_eq!(why.reason, "most_cached");
    assert!(why.labels.is_empty());
}

#[test]
fn a_row_not_current_is_read_without_overlap_and_the_reason_says_so() {
    let request = TestRequest::new(64, 16);
    for state in [
        KvIndexState::Unknown,
        KvIndexState::Stale,
        KvIndexState::Lagging,
    ] {
        let rows = rows().kv_index_states(&[state, KvIndexState::Current, KvIndexState::Current]);
        assert_eq!(
            rows.pick_worker(&Probe, &request).unwrap().worker_id,
            2,
            "{state}: worker 1's 8 blocks are not trusted"
        );
        let why = rows.explain(&Probe, &request).unwrap();
        assert_eq!(why.reason, "most_cached_kv_load_only");
        assert_eq!(
            why.labels,
            vec![("kv_load_only".to_owned(), format!("1:0={state}"))]
        );
    }
    // All current: the column changes nothing, not even the reason.
    let current = rows().kv_index_states(&[KvIndexState::Current; 3]);
    assert_eq!(current.pick_worker(&Probe, &request).unwrap().worker_id, 1);
    assert_eq!(
        current.explain(&Probe, &request).unwrap().reason,
        "most_cached"
    );
    // A row not current that caches nothing changed nothing: no suffix.
    let cold = rows().kv_index_states(&[
        KvIndexState::Current,
        KvIndexState::Current,
        KvIndexState::Stale,
    ]);
    assert_eq!(
        cold.explain(&Probe, &request).unwrap().reason,
        "most_cached"
    );
    // A column of the wrong length is absent (every row current), as for any extra column.
    let short = rows().extra_column(plugin_api::KV_INDEX_STATE, vec![2.0]);
    assert_eq!(short.pick_worker(&Probe, &request).unwrap().worker_id, 1);
}
