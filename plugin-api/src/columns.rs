//! Owned, reusable column buffers and the borrowed view they lend across the ABI.
//!
//! Hosts fill a [`Columns`] per request (reusing its capacity, so steady-state routing does not
//! allocate) and pass [`Columns::view`]; tests and benchmarks build views the same way.

use abi_stable::std_types::RSlice;

use crate::abi::{Inputs, RawCandidateView};

/// One `Vec` per column of [`RawCandidateView`], index-aligned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Columns {
    pub worker_id: Vec<u64>,
    pub dp_rank: Vec<u32>,
    pub device: Vec<f64>,
    pub host: Vec<f64>,
    pub disk: Vec<f64>,
    pub available: Vec<bool>,
    pub active_requests: Vec<u64>,
    pub active_prefill_tokens: Vec<u64>,
    pub decode_blocks: Vec<u64>,
}

impl Columns {
    /// Number of rows (the length of the identity columns).
    pub fn len(&self) -> usize {
        self.worker_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.worker_id.is_empty()
    }

    /// Empty every column, keeping the capacity.
    pub fn clear(&mut self) {
        self.worker_id.clear();
        self.dp_rank.clear();
        self.device.clear();
        self.host.clear();
        self.disk.clear();
        self.available.clear();
        self.active_requests.clear();
        self.active_prefill_tokens.clear();
        self.decode_blocks.clear();
    }

    /// The borrowed view with only the `inputs` column groups present; the others are empty,
    /// whatever the buffers hold.
    #[inline]
    pub fn view(&self, inputs: Inputs) -> RawCandidateView<'_> {
        fn col<T>(on: bool, v: &[T]) -> RSlice<'_, T> {
            if on {
                RSlice::from_slice(v)
            } else {
                RSlice::EMPTY
            }
        }
        let cache = inputs.contains(Inputs::CACHE);
        let load = inputs.contains(Inputs::LOAD);
        RawCandidateView {
            present: inputs,
            worker_id: RSlice::from_slice(&self.worker_id),
            dp_rank: RSlice::from_slice(&self.dp_rank),
            device_blocks: col(cache, &self.device),
            host_blocks: col(cache, &self.host),
            disk_blocks: col(cache, &self.disk),
            available: col(load, &self.available),
            active_requests: col(load, &self.active_requests),
            active_prefill_tokens: col(load, &self.active_prefill_tokens),
            decode_blocks: col(load, &self.decode_blocks),
            extra_columns: RSlice::EMPTY,
        }
    }
}
