//! [`Coalesce`]: the upstream body's chunks that are already received, joined into one piece.
//!
//! hyper writes every piece of a response body with its own syscall. An engine often sends a
//! short stream (or the tail of a long one) faster than the router relays it, so several SSE
//! events wait in the upstream connection's buffer at once; relaying them one by one cost a
//! `writev` and a loopback segment each (docs/performance.md, "`serve`: added
//! latency"). Only what is ready is joined:
//! a chunk the engine has not sent yet is never waited for, so no event is delayed, and the
//! bytes are the same, in the same order.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::Stream;

/// The most bytes joined into one piece.
pub const COALESCE_LIMIT: usize = 64 * 1024;

/// A body stream whose ready chunks come out joined, up to [`COALESCE_LIMIT`] bytes. An error
/// or the end met while joining comes out on the next poll, after the bytes before it.
pub struct Coalesce<S, E> {
    inner: Pin<Box<S>>,
    /// The error or end (`None`) met behind the last piece.
    after: Option<Option<E>>,
}

impl<S, E> Coalesce<S, E>
where
    S: Stream<Item = Result<Bytes, E>>,
{
    pub fn new(inner: S) -> Coalesce<S, E> {
        Coalesce {
            inner: Box::pin(inner),
            after: None,
        }
    }
}

impl<S, E> Stream for Coalesce<S, E>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: Unpin,
{
    type Item = Result<Bytes, E>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(after) = self.after.take() {
            return Poll::Ready(after.map(Err));
        }
        let first = match self.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(first))) => first,
            other => return other,
        };
        let mut joined: Option<Vec<u8>> = None;
        while joined.as_ref().map_or(first.len(), Vec::len) < COALESCE_LIMIT {
            match self.inner.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(next))) => joined
                    .get_or_insert_with(|| first.to_vec())
                    .extend_from_slice(&next),
                Poll::Ready(Some(Err(err))) => {
                    self.after = Some(Some(err));
                    break;
                }
                Poll::Ready(None) => {
                    self.after = Some(None);
                    break;
                }
                // The inner stream registered the waker: the caller is woken for what follows.
                Poll::Pending => break,
            }
        }
        Poll::Ready(Some(Ok(joined.map_or(first, Bytes::from))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yields its items, with `Pending` (waking itself at once) where an item is `None`.
    struct Scripted(std::collections::VecDeque<Option<Result<Bytes, String>>>);

    impl Stream for Scripted {
        type Item = Result<Bytes, String>;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            match self.0.pop_front() {
                Some(Some(item)) => Poll::Ready(Some(item)),
                Some(None) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                None => Poll::Ready(None),
            }
        }
    }

    fn chunk(text: &str) -> Option<Result<Bytes, String>> {
        Some(Ok(Bytes::copy_from_slice(text.as_bytes())))
    }

    fn run(script: Vec<Option<Result<Bytes, String>>>) -> Vec<Result<String, String>> {
        let steps = script.len() + 1;
        let mut stream = std::pin::pin!(Coalesce::new(Scripted(script.into())));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        for _ in 0..=steps {
            match stream.as_mut().poll_next(&mut cx) {
                Poll::Ready(Some(item)) => {
                    out.push(item.map(|b| String::from_utf8(b.to_vec()).unwrap()))
                }
                Poll::Ready(None) => return out,
                Poll::Pending => {}
            }
        }
        panic!("the stream did not end within {steps} polls: {out:?}")
    }

    #[test]
    fn ready_chunks_are_joined_and_a_gap_is_not_waited_for() {
        let out = run(vec![
            chunk("data: 1\n\n"),
            chunk("data: 2\n\n"),
            None,
            chunk("data: 3\n\n"),
            chunk("data: [DONE]\n\n"),
        ]);
        assert_eq!(
            out,
            vec![
                Ok("data: 1\n\ndata: 2\n\n".to_owned()),
                Ok("data: 3\n\ndata: [DONE]\n\n".to_owned())
            ]
        );
    }

    #[test]
    fn an_error_behind_ready_bytes_comes_after_them() {
        let out = run(vec![
            chunk("a"),
            chunk("b"),
            Some(Err("cut".into())),
            chunk("c"),
        ]);
        assert_eq!(
            out,
            vec![
                Ok("ab".to_owned()),
                Err("cut".to_owned()),
                Ok("c".to_owned())
            ]
        );
    }

    #[test]
    fn a_lone_chunk_is_passed_as_it_is_and_the_limit_bounds_a_piece() {
        assert_eq!(run(vec![chunk("only")]), vec![Ok("only".to_owned())]);
        let big = "x".repeat(COALESCE_LIMIT - 1);
        let out = run(vec![chunk(&big), chunk("yy"), chunk("z")]);
        assert_eq!(out.len(), 2, "the second piece starts past the limit");
        assert_eq!(out[0].as_ref().map(String::len), Ok(COALESCE_LIMIT + 1));
        assert_eq!(out[1], Ok("z".to_owned()));
    }
}
