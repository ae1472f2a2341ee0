//! The one eligibility view (docs/routing-contract.md §3): which rows a request may be routed to.
//!
//! Every caller that needs "the rows this request could go to" (selection, queue-admission busy
//! checks, queue readiness) goes through [`eligible_rows`], computed from one cluster snapshot,
//! so admission and selection can never disagree about eligibility.

use crate::model::{Cluster, Request, RowId};

/// Why a request has no row to go to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EligibilityError {
    #[error("pinned worker not allowed: worker {} is not in the request's allow-list", .0.worker_id)]
    PinnedNotAllowed(RowId),
    #[error("no endpoints: pinned worker {}:{} is unknown, has no such rank, or is unavailable", .0.worker_id, .0.dp_rank)]
    PinnedUnavailable(RowId),
    #[error("pinned worker overloaded: worker {}", .0.worker_id)]
    PinnedOverloaded(RowId),
    #[error("no endpoints: no registered, available worker is allowed for this request")]
    NoEndpoints,
    #[error("all eligible workers overloaded")]
    AllOverloaded,
}

fn allowed(request: &Request, worker_id: u64) -> bool {
    request
        .allowed_worker_ids
        .as_ref()
        .is_none_or(|ids| ids.contains(&worker_id))
}

/// Allow-lists up to this long are checked by a linear scan per worker.
const LINEAR_ALLOW_LIST: usize = 16;

/// The eligible rows of `request` (worker order, then rank order): the cluster's own rows when
/// every row is eligible (no copy: the common case at thousands of rows), else `out` filled by
/// [`eligible_rows`].
pub fn eligible<'a>(
    cluster: &'a Cluster,
    request: &Request,
    pin: Option<RowId>,
    out: &'a mut Vec<RowId>,
) -> Result<&'a [RowId], EligibilityError> {
    if whole_fleet(cluster, request, pin) {
        return Ok(cluster.rows());
    }
    walk(cluster, request, pin, out)?;
    Ok(out)
}

/// Whether every row of `cluster` is eligible for `request` whatever the rest of the rules
/// say: no pin, no allow-list, every worker routable.
fn whole_fleet(cluster: &Cluster, request: &Request, pin: Option<RowId>) -> bool {
    pin.is_none()
        && request.allowed_worker_ids.is_none()
        && cluster.all_routable()
        && !cluster.rows().is_empty()
}

/// Fill `out` with the eligible rows of `request` (worker order, then rank order).
///
/// `pin` is the row the request must go to, if any: the explicit pinned worker, or a hard session
/// binding (which behaves like a pin). With a pin the only row is the pin itself.
pub fn eligible_rows(
    cluster: &Cluster,
    request: &Request,
    pin: Option<RowId>,
    out: &mut Vec<RowId>,
) -> Result<(), EligibilityError> {
    if whole_fleet(cluster, request, pin) {
        out.clear();
        out.extend_from_slice(cluster.rows());
        return Ok(());
    }
    walk(cluster, request, pin, out)
}

/// [`eligible_rows`] when not every row is eligible (or might not be): the pin, or each worker's
/// flags and the allow-list, worker by worker.
fn walk(
    cluster: &Cluster,
    request: &Request,
    pin: Option<RowId>,
    out: &mut Vec<RowId>,
) -> Result<(), EligibilityError> {
    out.clear();
    if let Some(pin) = pin {
        check_pin(cluster, request, pin)?;
        out.push(pin);
        return Ok(());
    }
    let mut excluded_for_overload = false;
    let mut admit = |worker: &crate::model::Worker, out: &mut Vec<RowId>| {
        if !worker.available || worker.draining {
            return;
        }
        if worker.overloaded {
            excluded_for_overload = true;
            return;
        }
        out.extend(worker.rows());
    };
    match request.allowed_worker_ids.as_deref() {
        // A long allow-list is walked once, looking each id up in the sorted cluster, instead of
        // being scanned for every worker; sorting restores worker order and drops repeated ids.
        Some(ids) if ids.len() > LINEAR_ALLOW_LIST => {
            for &id in ids {
                if let Some(worker) = cluster.worker(id) {
                    admit(worker, out);
                }
            }
            out.sort_unstable();
            out.dedup();
        }
        _ => {
            for worker in cluster.workers() {
                if allowed(request, worker.worker_id) {
                    admit(worker, out);
                }
            }
        }
    }
    if out.is_empty() {
        return Err(if excluded_for_overload {
            EligibilityError::AllOverloaded
        } else {
            EligibilityError::NoEndpoints
        });
    }
    Ok(())
}

/// The pin rules of §3: allow-list first, then existence/availability, then overload.
pub fn check_pin(cluster: &Cluster, request: &Request, pin: RowId) -> Result<(), EligibilityError> {
    if !allowed(request, pin.worker_id) {
        return Err(EligibilityError::PinnedNotAllowed(pin));
    }
    match cluster.worker(pin.worker_id) {
        Some(w) if w.available && !w.draining && w.has_rank(pin.dp_rank) => {
            if w.overloaded {
                Err(EligibilityError::PinnedOverloaded(pin))
            } else {
                Ok(())
            }
        }
        _ => Err(EligibilityError::PinnedUnavailable(pin)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Worker;

    fn cluster() -> Cluster {
        let mut busy = Worker::new(3);
        busy.overloaded = true;
        let mut down = Worker::new(4);
        down.available = false;
        Cluster::new(vec![
            Worker::new(2).with_ranks(0, 2),
            Worker::new(1),
            busy,
            down,
        ])
        .unwrap()
    }

    fn rows(request: &Request, pin: Option<RowId>) -> Result<Vec<RowId>, EligibilityError> {
        let mut out = Vec::new();
        eligible_rows(&cluster(), request, pin, &mut out).map(|()| out)
    }

    fn row(worker_id: u64, dp_rank: u32) -> RowId {
        RowId { worker_id, dp_rank }
    }

    #[test]
    fn every_rank_of_every_available_not_overloaded_worker_in_worker_order() {
        let got = rows(&Request::default(), None).unwrap();
        assert_eq!(got, vec![row(1, 0), row(2, 0), row(2, 1)]);
    }

    /// With every worker routable the cluster's own rows are handed out; each flag that takes
    /// a worker out (set through a topology edit, as the core does) gives the rows of the
    /// others, as walking the workers does.
    #[test]
    fn the_whole_fleet_is_the_clusters_rows_until_a_flag_takes_a_worker_out() {
        let mut alloc = crate::topology::SlotAllocator::default();
        let t0 = alloc.initial(
            Cluster::new(vec![
                Worker::new(2).with_ranks(0, 2),
                Worker::new(1),
                Worker::new(3).with_ranks(4, 3),
            ])
            .unwrap(),
        );
        let eligible = |cluster: &Cluster| {
            let mut out = Vec::new();
            eligible_rows(cluster, &Request::default(), None, &mut out).map(|()| out)
        };
        assert!(t0.cluster().all_routable());
        let all = eligible(t0.cluster()).unwrap();
        assert_eq!(all, t0.cluster().rows());
        assert_eq!(
            all,
            [
                row(1, 0),
                row(2, 0),
                row(2, 1),
                row(3, 4),
                row(3, 5),
                row(3, 6)
            ]
        );
        let flags: [fn(&mut Worker); 3] = [
            |w| w.available = false,
            |w| w.draining = true,
            |w| w.overloaded = true,
        ];
        for flag in flags {
            let t1 = alloc.edit(&t0, 2, flag).unwrap();
            assert!(!t1.cluster().all_routable());
            assert_eq!(
                eligible(t1.cluster()).unwrap(),
                [row(1, 0), row(3, 4), row(3, 5), row(3, 6)]
            );
            let t2 = alloc.edit(&t1, 2, |w| *w = Worker::new(2)).unwrap();
            assert!(t2.cluster().all_routable());
            assert_eq!(
                eligible(t2.cluster()).unwrap(),
                all,
                "ranks kept by the edit"
            );
        }
    }

    #[test]
    fn allow_list_restricts_workers() {
        let request = Request {
            allowed_worker_ids: Some(vec![2]),
            ..Default::default()
        };
        assert_eq!(rows(&request, None).unwrap(), vec![row(2, 0), row(2, 1)]);
    }

    #[test]
    fn a_long_allow_list_gives_the_same_rows_as_a_short_one() {
        // Unsorted, repeated and unknown ids; longer than the linear-scan limit.
        let mut ids: Vec<u64> = vec![2, 99, 1, 2, 4];
        ids.extend(1000..1000 + LINEAR_ALLOW_LIST as u64);
        let long = Request {
            allowed_worker_ids: Some(ids),
            ..Default::default()
        };
        assert_eq!(
            rows(&long, None).unwrap(),
            vec![row(1, 0), row(2, 0), row(2, 1)]
        );
        let mut overloaded_only: Vec<u64> = vec![3, 4];
        overloaded_only.extend(1000..1000 + LINEAR_ALLOW_LIST as u64);
        let long = Request {
            allowed_worker_ids: Some(overloaded_only),
            ..Default::default()
        };
        assert_eq!(rows(&long, None), Err(EligibilityError::AllOverloaded));
    }

    #[test]
    fn only_overloaded_left_is_reported_as_overload() {
        let request = Request {
            allowed_worker_ids: Some(vec![3, 4]),
            ..Default::default()
        };
        assert_eq!(rows(&request, None), Err(EligibilityError::AllOverloaded));
        let request = Request {
            allowed_worker_ids: Some(vec![4, 99]),
            ..Default::default()
        };
        assert_eq!(rows(&request, None), Err(EligibilityError::NoEndpoints));
    }

    #[test]
    fn pin_rules_in_design_order() {
        assert_eq!(
            rows(&Request::default(), Some(row(2, 1))).unwrap(),
            vec![row(2, 1)]
        );
        let restricted = Request {
            allowed_worker_ids: Some(vec![1]),
            ..Default::default()
        };
        assert_eq!(
            rows(&restricted, Some(row(2, 0))),
            Err(EligibilityError::PinnedNotAllowed(row(2, 0)))
        );
        for gone in [row(99, 0), row(2, 2), row(4, 0)] {
            assert_eq!(
                rows(&Request::default(), Some(gone)),
                Err(EligibilityError::PinnedUnavailable(gone))
            );
        }
        assert_eq!(
            rows(&Request::default(), Some(row(3, 0))),
            Err(EligibilityError::PinnedOverloaded(row(3, 0)))
        );
    }
}
