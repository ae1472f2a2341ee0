use super::*;
use router_config::MAX_DP_SIZE;

#[test]
fn minimal_scenario_takes_the_documented_defaults() {
    let s = Scenario::from_json_str(
        r#"{"workers": [{"worker_id": 29}], "requests": [{"isl_tokens": 160}]}"#,
        "t.json",
    )
    .unwrap();
    let w = &s.cluster.workers()[0];
    assert_eq!(
        (w.dp_start, w.dp_size, w.available, w.overloaded),
        (0, 1, true, false)
    );
    assert_eq!(s.requests[0].request.role, RequestRole::Aggregated);
    assert!(s.requests[0].rows.is_empty());
}

#[test]
fn errors_name_file_line_and_field() {
    let err = Scenario::from_json_str(
        "{\"workers\": [],\n \"requests\": [{\"isl_tokens\": 1, \"colour\": 2}]}",
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("s.json: line 2"), "{err}");
    assert!(err.contains("unknown field `colour`"), "{err}");

    let err = Scenario::from_json_str(
        r#"{"workers": [{"worker_id": 1}, {"worker_id": 1}], "requests": []}"#,
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("duplicate worker_id 1"), "{err}");

    let err = Scenario::from_json_str(
        r#"{"workers": [], "requests": [{"isl_tokens": 1, "complete": [0]}]}"#,
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("requests[0]: complete: request 0"), "{err}");

    let err = Scenario::from_json_str(
        r#"{"workers": [], "requests": [{"isl_tokens": 99999999999999999999999}]}"#,
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("line 1"), "{err}");

    let err = Scenario::from_json_str(
        r#"{"workers": [], "requests": [{"isl_tokens": 1}, {"isl_tokens": 0}]}"#,
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("requests[1]: isl_tokens: must be at least 1"),
        "{err}"
    );
}

#[test]
fn a_scenario_that_is_not_an_object_is_refused_naming_the_file() {
    // Issue: the derived parser took an array of the fields in order for a scenario.
    for text in [
        r#"[[{"worker_id": 1}], [{"isl_tokens": 1}]]"#,
        r#"[null, [{"worker_id": 1}], [{"isl_tokens": 1}]]"#,
        "[]",
        "7",
        r#""workers""#,
    ] {
        let err = Scenario::from_json_str(text, "s.json")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("scenario s.json: line 1 column "), "{err}");
        assert!(
            err.ends_with("expected a scenario object with `workers` and `requests`"),
            "{err}"
        );
    }
    let err = Scenario::from_json_str(r#"[[{"worker_id": 1}], [{"isl_tokens": 1}]]"#, "s.json")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "scenario s.json: line 1 column 0: invalid type: sequence, expected a scenario object \
         with `workers` and `requests`"
    );
    // The object form, with whitespace before it, is unchanged.
    let s = Scenario::from_json_str(
        " \n{\"workers\": [{\"worker_id\": 1}], \"requests\": [{\"isl_tokens\": 1}]}",
        "s.json",
    )
    .unwrap();
    assert_eq!(s.requests.len(), 1);
    let err = Scenario::from_json_str(
        r#"{"workers": [], "requests": [], "workers": []}"#,
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("duplicate field `workers`"), "{err}");
    let err = Scenario::from_json_str(r#"{"workers": []}"#, "s.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing field `requests`"), "{err}");
}

#[test]
fn every_object_of_a_scenario_written_as_an_array_is_refused_naming_its_place() {
    // The derived parser took an array of a struct's fields in order, at every level below
    // the top: `{"workers": [[1, 0, 2]]}` was worker 1 with two ranks.
    let request = |extra: &str| {
        format!(
            r#"{{"workers": [{{"worker_id": 1}}], "requests": [{{"isl_tokens": 1}}, {{"isl_tokens": 1{extra}}}]}}"#
        )
    };
    for (text, place, what) in [
        (
            r#"{"workers": [[1, 0, 2]], "requests": []}"#.to_owned(),
            "workers[0]",
            "a worker object with `worker_id`",
        ),
        (
            r#"{"workers": [{"worker_id": 1}], "requests": [{"isl_tokens": 1}, [16]]}"#.to_owned(),
            "requests[1]",
            "a request object with `isl_tokens`",
        ),
        (
            request(r#", "rows": [[1, 0, 5.0]]"#),
            "requests[1].rows[0]",
            "a row object with `worker_id`",
        ),
        (
            request(r#", "affinity_target": [1, 0]"#),
            "requests[1].affinity_target",
            "an affinity target object with `worker_id`",
        ),
        (
            request(r#", "pinned_worker": [1, 0]"#),
            "requests[1].pinned_worker",
            "a pinned worker object with `worker_id`",
        ),
        (
            request(r#", "worker_updates": [[1, false]]"#),
            "requests[1].worker_updates[0]",
            "a worker update object with `worker_id`",
        ),
    ] {
        let err = Scenario::from_json_str(&text, "s.json")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("scenario s.json: line 1 column ")
                && err.ends_with(&format!(
                    ": {place}: invalid type: sequence, expected {what}"
                )),
            "{text}: {err}"
        );
    }
}

#[test]
fn rows_beyond_the_cap_are_refused_before_anything_is_allocated() {
    // Found while writing the `select_scenario` fuzz target: 80 bytes asking for 4e9 rows made the first
    // request try to allocate 64 GB for its eligible rows.
    let err = Scenario::from_json_str(
        r#"{"workers": [{"worker_id": 1, "dp_size": 4000000000}, {"worker_id": 2, "dp_size": 4000000000}],
            "requests": [{"isl_tokens": 1}]}"#,
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "scenario s.json: line 1 column 51: workers[0].dp_size: invalid value: integer \
         `4000000000` is out of range, expected an integer from 1 to 65536"
    );
    // Within the dp_size cap, over the total.
    let workers = |n: u64| {
        (0..n)
            .map(|id| format!(r#"{{"worker_id": {id}, "dp_size": {MAX_DP_SIZE}}}"#))
            .collect::<Vec<_>>()
            .join(",")
    };
    let err = Scenario::from_json_str(
        &format!(r#"{{"workers": [{}], "requests": []}}"#, workers(17)),
        "s.json",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "scenario s.json: workers: 1114112 rows in total (the sum of every dp_size), \
         over the limit of 1048576"
    );
    // Exactly at the cap is fine.
    let s = Scenario::from_json_str(
        &format!(r#"{{"workers": [{}], "requests": []}}"#, workers(16)),
        "s.json",
    )
    .unwrap();
    assert_eq!(s.cluster.row_count(), MAX_SCENARIO_ROWS);
}

#[test]
fn requests_times_rows_beyond_the_budget_are_refused_before_any_is_decided() {
    let scenario = |requests: u64| {
        let requests = vec![r#"{"isl_tokens": 1}"#; requests as usize].join(",");
        format!(
            r#"{{"workers": [{{"worker_id": 1, "dp_size": {MAX_DP_SIZE}}}], "requests": [{requests}]}}"#
        )
    };
    let at_budget = MAX_SCENARIO_ROW_DECISIONS / MAX_DP_SIZE;
    let s = Scenario::from_json_str(&scenario(at_budget), "s.json").unwrap();
    assert_eq!(s.requests.len() as u64, at_budget);
    let err = Scenario::from_json_str(&scenario(at_budget + 1), "s.json")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "scenario s.json: 2049 requests over 65536 rows is 134283264 row decisions, over the \
         limit of 134217728 (requests times rows); use fewer rows or split the scenario"
    );
}
