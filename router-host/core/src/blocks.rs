//! Block ids: the one place that turns token ids into the ids the KV index keys blocks by.
//!
//! A block id identifies the *whole prefix* up to and including its block, so two prompts share
//! the id of block `i` exactly when they share their first `i + 1` full blocks. The same rule
//! serves prompts (tokenized requests, [`BlockHasher::prompt_blocks`]) and blocks engines report
//! in KV events (vLLM's `BlockStored` carries `token_ids`, `parent_block_hash` and `block_size`:
//! [`BlockHasher::chain`] from the parent's router id). Operator reference: `docs/block-ids.md`.
//!
//! # The rule
//!
//! - Only full blocks of `block_size` tokens get ids; a trailing partial block has none.
//! - `h[i] = H(h[i-1], tokens of block i)`, with `h[-1] = root`.
//! - The root separates tenants: it is derived from an optional LoRA adapter name and an optional
//!   cache salt (vLLM's `cache_salt`), so two tenants' identical prompts never share ids. With
//!   neither set the root is [`NO_TENANT_ROOT`], derived the same way from two absent fields
//!   (not special-cased).
//!
//! # The encoding
//!
//! `H` is xxh3-64 with seed 0 and the default secret (`xxhash_rust::xxh3::xxh3_64`; Python's
//! `xxhash.xxh3_64_intdigest`), over these bytes (`||` is concatenation, `le8`/`le4` are 8 and
//! 4 little-endian bytes):
//!
//! ```text
//! block:  le8(parent) || le4(token[0]) || ... || le4(token[block_size - 1])
//! root:   "router-core/block-root/v1" || field(lora) || field(cache_salt)
//! field(None)    = 0x00
//! field(Some(s)) = 0x01 || le8(byte length of s) || UTF-8 bytes of s
//! ```
//!
//! Both encodings are unambiguous: a block's is fixed-width, and each root field carries a
//! presence tag and a length, so `lora = "ab"` with no salt differs from `lora = "a"` with salt
//! `"b"`, and an empty name differs from no name. The root starts with an ASCII domain tag where
//! a block starts with its parent id, so a root input equals a block input only if some parent id
//! equals those tag bytes: a 64-bit collision, the same odds every id here already rests on.
//!
//! Hashing a prompt allocates nothing except growing the caller's output `Vec`: a block is
//! encoded into a fixed stack buffer (or streamed through it when a block is larger than the
//! buffer).

use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

/// The domain tag that starts every root encoding (never a block encoding).
pub const ROOT_DOMAIN: &[u8] = b"router-core/block-root/v1";

/// The root with no LoRA adapter and no cache salt: `H(ROOT_DOMAIN || 0x00 || 0x00)`.
pub const NO_TENANT_ROOT: u64 = 0x2690_5e8c_ba42_90ed;

/// Who a prompt belongs to, for the root. `Default` is neither field set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Tenant<'a> {
    /// The LoRA adapter the request runs with, if any.
    pub lora: Option<&'a str>,
    /// The request's cache salt (vLLM's `cache_salt`), if any.
    pub cache_salt: Option<&'a str>,
}

impl Tenant<'_> {
    /// This tenant's root: `H(ROOT_DOMAIN || field(lora) || field(cache_salt))`.
    pub fn root(&self) -> u64 {
        let mut h = Xxh3Default::new();
        h.update(ROOT_DOMAIN);
        for field in [self.lora, self.cache_salt] {
            match field {
                None => h.update(&[0x00]),
                Some(s) => {
                    h.update(&[0x01]);
                    h.update(&(s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        h.digest()
    }
}

/// Why a [`BlockHasher`] or a block id could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockHashError {
    #[error("block size must be at least 1 token, got 0")]
    ZeroBlockSize,
    #[error("a block must have exactly block_size = {block_size} tokens, got {got}")]
    WrongBlockLength { block_size: u32, got: usize },
}

/// Computes block ids for one block size and one tenant (see the module docs for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: u32,
    root: u64,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens (must match the engine's) under `tenant`.
    pub fn new(block_size: u32, tenant: Tenant<'_>) -> Result<Self, BlockHashError> {
        if block_size == 0 {
            return Err(BlockHashError::ZeroBlockSize);
        }
        Ok(BlockHasher {
            block_size,
            root: tenant.root(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The tenant's root: the parent of the first block.
    pub fn root(&self) -> u64 {
        self.root
    }

    /// Ids of every full block of `tokens`, appended to `out` (out is cleared first). A trailing
    /// partial block gets none; fewer than `block_size` tokens give none.
    pub fn prompt_blocks(&self, tokens: &[u32], out: &mut Vec<u64>) {
        out.clear();
        let blocks = tokens.chunks_exact(self.block_size as usize);
        out.reserve(blocks.len());
        let mut parent = self.root;
        for block in blocks {
            parent = block_hash(parent, block);
            out.push(parent);
        }
    }

    /// The id of one block given its parent's id (`None` = first block: the root is the
    /// parent). Errors when `tokens.len() != block_size`.
    pub fn chain(&self, parent: Option<u64>, tokens: &[u32]) -> Result<u64, BlockHashError> {
        if tokens.len() != self.block_size as usize {
            return Err(BlockHashError::WrongBlockLength {
                block_size: self.block_size,
                got: tokens.len(),
            });
        }
        Ok(block_hash(parent.unwrap_or(self.root), tokens))
    }
}

/// Tokens encoded per pass through the stack buffer (blocks up to this size hash in one call).
const STACK_TOKENS: usize = 64;

/// `H(le8(parent) || le4(token)...)`, through a fixed stack buffer.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = [0u8; 8 + 4 * STACK_TOKENS];
    if tokens.len() <= STACK_TOKENS {
        let n = 8 + 4 * tokens.len();
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        for (dst, t) in buf[8..n].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64(&buf[..n]);
    }
    let mut h = Xxh3Default::new();
    h.update(&parent.to_le_bytes());
    for chunk in tokens.chunks(STACK_TOKENS) {
        let n = 4 * chunk.len();
        for (dst, t) in buf[..n].chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..n]);
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn hasher(block_size: u32) -> BlockHasher {
        BlockHasher::new(block_size, Tenant::default()).unwrap()
    }

    fn ids(h: &BlockHasher, tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::new();
        h.prompt_blocks(tokens, &mut out);
        out
    }

    /// The documented block encoding, built the obvious (allocating) way.
    fn block_bytes(parent: u64, tokens: &[u32]) -> Vec<u8> {
        let mut b = parent.to_le_bytes().to_vec();
        for t in tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        b
    }

    /// The documented root encoding, built the obvious (allocating) way.
    fn root_bytes(tenant: Tenant<'_>) -> Vec<u8> {
        let mut b = ROOT_DOMAIN.to_vec();
        for field in [tenant.lora, tenant.cache_salt] {
            match field {
                None => b.push(0),
                Some(s) => {
                    b.push(1);
                    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    b.extend_from_slice(s.as_bytes());
                }
            }
        }
        b
    }

    #[test]
    fn pinned_known_values_match_the_documented_encoding() {
        // The no-tenant root: a pinned literal, and the documented encoding hashed directly.
        let expected_root_bytes = b"router-core/block-root/v1\x00\x00";
        assert_eq!(root_bytes(Tenant::default()), expected_root_bytes);
        assert_eq!(xxh3_64(expected_root_bytes), NO_TENANT_ROOT);
        assert_eq!(Tenant::default().root(), NO_TENANT_ROOT);
        assert_eq!(hasher(4).root(), NO_TENANT_ROOT);

        // A tenant root, spelled out byte by byte.
        let tenant = Tenant {
            lora: Some("ab"),
            cache_salt: Some("s"),
        };
        let spelled: &[u8] = b"router-core/block-root/v1\
            \x01\x02\x00\x00\x00\x00\x00\x00\x00ab\
            \x01\x01\x00\x00\x00\x00\x00\x00\x00s";
        assert_eq!(root_bytes(tenant), spelled);
        assert_eq!(tenant.root(), xxh3_64(spelled));
        assert_eq!(tenant.root(), 0x430b_566e_4cff_8488);

        // Two full blocks of 4 and a partial one; block 0's parent is the root.
        let h = hasher(4);
        let got = ids(&h, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(got, vec![0xe17b_6664_480b_6fea, 0x866d_bff4_3edc_58d6]);
        let b0: &[u8] = &[
            0xed, 0x90, 0x42, 0xba, 0x8c, 0x5e, 0x90, 0x26, // le8(NO_TENANT_ROOT)
            1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, // le4 of tokens 1, 2, 3, 4
        ];
        assert_eq!(b0, block_bytes(NO_TENANT_ROOT, &[1, 2, 3, 4]));
        assert_eq!(got[0], xxh3_64(b0));
        assert_eq!(got[1], xxh3_64(&block_bytes(got[0], &[5, 6, 7, 8])));
        // The documented rule through the public API, too.
        assert_eq!(h.chain(None, &[1, 2, 3, 4]), Ok(got[0]));
        assert_eq!(h.chain(Some(got[0]), &[5, 6, 7, 8]), Ok(got[1]));
    }

    #[test]
    fn large_blocks_stream_to_the_same_value_as_one_call() {
        let mut rng = SplitMix64::new(7);
        for block_size in [1u32, 2, 16, 63, 64, 65, 128, 200, 1000] {
            let h = hasher(block_size);
            let tokens: Vec<u32> = (0..block_size * 3).map(|_| rng.next_u64() as u32).collect();
            let got = ids(&h, &tokens);
            assert_eq!(got.len(), 3);
            let mut parent = NO_TENANT_ROOT;
            for (i, block) in tokens.chunks_exact(block_size as usize).enumerate() {
                parent = xxh3_64(&block_bytes(parent, block));
                assert_eq!(got[i], parent, "block size {block_size}, block {i}");
            }
        }
    }

    #[test]
    fn shared_prefix_shares_exactly_those_ids() {
        let h = hasher(2);
        // Blocks: [1,2] [3,4] [5,6] [7,8] vs [1,2] [3,4] [9,9] [7,8]: the last block is equal
        // but its prefix is not.
        let a = ids(&h, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let b = ids(&h, &[1, 2, 3, 4, 9, 9, 7, 8]);
        assert_eq!(a.len(), 4);
        assert_eq!(b.len(), 4);
        assert_eq!(a[..2], b[..2]);
        for i in 2..4 {
            assert_ne!(a[i], b[i], "block {i}");
        }
        // A difference in block 0 changes every id, even with later blocks identical.
        let c = ids(&h, &[0, 2, 3, 4, 5, 6, 7, 8]);
        for i in 0..4 {
            assert_ne!(a[i], c[i], "block {i}");
        }
        // Ids are not per-block content hashes: equal blocks at different places differ.
        let d = ids(&h, &[1, 2, 1, 2]);
        assert_ne!(d[0], d[1]);
    }

    #[test]
    fn trailing_partial_block_is_ignored() {
        let h = hasher(4);
        let full = ids(&h, &[1, 2, 3, 4, 5, 6, 7, 8]);
        for extra in 1..4u32 {
            let mut tokens = vec![1, 2, 3, 4, 5, 6, 7, 8];
            tokens.extend(100..100 + extra);
            assert_eq!(ids(&h, &tokens), full, "{extra} trailing tokens");
        }
        assert_eq!(ids(&h, &[1, 2, 3]), Vec::<u64>::new());
    }

    #[test]
    fn empty_prompt_gives_no_ids_and_clears_out() {
        let h = hasher(4);
        let mut out = vec![1, 2, 3];
        h.prompt_blocks(&[], &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn out_is_cleared_and_reused_without_reallocating() {
        let h = hasher(4);
        let tokens: Vec<u32> = (0..400).collect();
        let mut out = Vec::with_capacity(100);
        out.push(42);
        let ptr = out.as_ptr();
        h.prompt_blocks(&tokens, &mut out);
        assert_eq!(out.len(), 100);
        assert_eq!(out.as_ptr(), ptr);
        assert_eq!(out, ids(&h, &tokens));
    }

    #[test]
    fn chain_block_by_block_equals_prompt_blocks() {
        for block_size in [1u32, 3, 16, 100] {
            let h = BlockHasher::new(
                block_size,
                Tenant {
                    lora: Some("x"),
                    cache_salt: None,
                },
            )
            .unwrap();
            let tokens: Vec<u32> = (0..block_size * 5 + 1).map(|t| t * 7 + 1).collect();
            let mut parent = None;
            let mut chained = Vec::new();
            for block in tokens.chunks_exact(block_size as usize) {
                let id = h.chain(parent, block).unwrap();
                chained.push(id);
                parent = Some(id);
            }
            assert_eq!(chained, ids(&h, &tokens), "block size {block_size}");
            // `None` means the root is the parent.
            assert_eq!(
                h.chain(None, &tokens[..block_size as usize]),
                h.chain(Some(h.root()), &tokens[..block_size as usize])
            );
        }
    }

    #[test]
    fn tenants_are_separated() {
        let tenants = [
            Tenant::default(),
            Tenant {
                lora: Some("a"),
                cache_salt: None,
            },
            Tenant {
                lora: None,
                cache_salt: Some("a"),
            },
            Tenant {
                lora: Some("a"),
                cache_salt: Some("a"),
            },
            // The ambiguity case: the same bytes "ab" split differently.
            Tenant {
                lora: Some("ab"),
                cache_salt: None,
            },
            Tenant {
                lora: Some("a"),
                cache_salt: Some("b"),
            },
            Tenant {
                lora: None,
                cache_salt: Some("ab"),
            },
            // Empty names are present, not absent.
            Tenant {
                lora: Some(""),
                cache_salt: None,
            },
            Tenant {
                lora: None,
                cache_salt: Some(""),
            },
            Tenant {
                lora: Some(""),
                cache_salt: Some(""),
            },
        ];
        let tokens: Vec<u32> = (0..8).collect();
        let per_tenant: Vec<(u64, Vec<u64>)> = tenants
            .iter()
            .map(|&t| {
                let h = BlockHasher::new(4, t).unwrap();
                (h.root(), ids(&h, &tokens))
            })
            .collect();
        for i in 0..tenants.len() {
            assert_eq!(per_tenant[i].0, xxh3_64(&root_bytes(tenants[i])));
            for j in i + 1..tenants.len() {
                let (ti, tj) = (&tenants[i], &tenants[j]);
                assert_ne!(
                    per_tenant[i].0, per_tenant[j].0,
                    "roots of {ti:?} and {tj:?}"
                );
                for k in 0..2 {
                    assert_ne!(
                        per_tenant[i].1[k], per_tenant[j].1[k],
                        "block {k} of {ti:?} and {tj:?}"
                    );
                }
            }
        }
        // The same tenant gives the same ids.
        let again = BlockHasher::new(4, tenants[5]).unwrap();
        assert_eq!(ids(&again, &tokens), per_tenant[5].1);
    }

    #[test]
    fn zero_block_size_is_refused() {
        assert_eq!(
            BlockHasher::new(0, Tenant::default()),
            Err(BlockHashError::ZeroBlockSize)
        );
        assert!(BlockHasher::new(1, Tenant::default()).is_ok());
    }

    #[test]
    fn chain_with_wrong_length_is_refused_naming_both_lengths() {
        let h = hasher(16);
        for len in [0usize, 15, 17] {
            let tokens = vec![5u32; len];
            let err = h.chain(None, &tokens).unwrap_err();
            assert_eq!(
                err,
                BlockHashError::WrongBlockLength {
                    block_size: 16,
                    got: len
                }
            );
            let msg = err.to_string();
            assert!(msg.contains("16"), "{msg}");
            assert!(msg.contains(&format!("got {len}")), "{msg}");
        }
        assert!(h.chain(None, &[5; 16]).is_ok());
    }

    #[test]
    fn random_prompts_share_exactly_their_common_full_blocks() {
        let mut rng = SplitMix64::new(0x5eed_b10c);
        let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
        for case in 0..400 {
            let block_size = 1 + rng.below(8) as u32;
            let bs = block_size as usize;
            let h = hasher(block_size);
            // A tiny vocabulary, so equal blocks after the divergence are common.
            let vocab = 2 + rng.below(3);
            let len = rng.below(60) as usize;
            let a: Vec<u32> = (0..len).map(|_| rng.below(vocab) as u32).collect();
            // b: a's first `keep` tokens, then (maybe) one changed token, then a's rest or a
            // fresh random tail.
            let keep = rng.below(len as u64 + 1) as usize;
            let mut b = a[..keep].to_vec();
            let diverges = keep < len && rng.below(4) != 0;
            if diverges {
                let old = u64::from(a[keep]);
                b.push(((old + 1 + rng.below(vocab - 1)) % vocab) as u32);
                if rng.below(2) == 0 {
                    b.extend_from_slice(&a[keep + 1..]);
                } else {
                    let tail = rng.below(30) as usize;
                    b.extend((0..tail).map(|_| rng.below(vocab) as u32));
                }
            }
            h.prompt_blocks(&a, &mut a_ids);
            h.prompt_blocks(&b, &mut b_ids);
            assert_eq!(a_ids.len(), a.len() / bs, "case {case}");
            assert_eq!(b_ids.len(), b.len() / bs, "case {case}");
            // The first differing token (if any) bounds the shared full blocks.
            let first_diff = a.iter().zip(&b).position(|(x, y)| x != y);
            let shared = match first_diff {
                Some(p) => p / bs,
                None => a_ids.len().min(b_ids.len()),
            };
            let common = a_ids.len().min(b_ids.len());
            assert_eq!(a_ids[..shared], b_ids[..shared], "case {case}");
            for i in shared..common {
                assert_ne!(a_ids[i], b_ids[i], "case {case}, block {i}");
            }
        }
    }
}
