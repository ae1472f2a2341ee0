//! The log sink handed to plugins: their lines re-enter the host's `tracing`, each plugin within
//! a budget per window.

use std::sync::OnceLock;
use std::time::Duration;

use plugin_api::abi::{HostLog, LogLevel, LogRecord};

use crate::loader::plugin_text;

/// The log sink handed to plugins: their events re-enter the host's `tracing` here.
pub fn host_log() -> HostLog {
    use tracing::level_filters::LevelFilter;
    let max_level = match LevelFilter::current() {
        LevelFilter::OFF => LogLevel(0),
        LevelFilter::ERROR => LogLevel::ERROR,
        LevelFilter::WARN => LogLevel::WARN,
        LevelFilter::INFO => LogLevel::INFO,
        LevelFilter::DEBUG => LogLevel::DEBUG,
        _ => LogLevel::TRACE,
    };
    HostLog {
        emit: emit_plugin_log,
        max_level,
    }
}

/// Log lines one plugin may write per [`PLUGIN_LOG_WINDOW`]; past that, its lines are counted and
/// not written, so a plugin that logs on every pick cannot flood the host's log.
pub const PLUGIN_LOG_LINES_PER_WINDOW: u64 = 100;
/// The window of [`PLUGIN_LOG_LINES_PER_WINDOW`].
pub const PLUGIN_LOG_WINDOW: Duration = Duration::from_secs(10);
/// Plugin names with a budget of their own; lines of further names share one budget.
const PLUGIN_LOG_NAMES_MAX: usize = 64;

/// One plugin's log budget in the current window.
#[derive(Debug, Default)]
struct PluginLogBudget {
    window_start_ns: u64,
    written: u64,
    dropped: u64,
}

/// What to do with one plugin log line.
#[derive(Debug, PartialEq, Eq)]
enum PluginLogVerdict {
    /// Write it; `dropped_before`: lines of the previous window that were not written.
    Write {
        dropped_before: u64,
    },
    /// Write it, then say that the budget is spent for the rest of the window.
    WriteLast,
    Drop,
}

impl PluginLogBudget {
    fn admit(&mut self, now_ns: u64, window_ns: u64, limit: u64) -> PluginLogVerdict {
        let mut dropped_before = 0;
        if now_ns.saturating_sub(self.window_start_ns) >= window_ns || self.written == 0 {
            dropped_before = std::mem::take(&mut self.dropped);
            self.window_start_ns = now_ns;
            self.written = 0;
        }
        if self.written >= limit {
            self.dropped += 1;
            return PluginLogVerdict::Drop;
        }
        self.written += 1;
        if self.written == limit {
            return PluginLogVerdict::WriteLast;
        }
        PluginLogVerdict::Write { dropped_before }
    }
}

fn plugin_log_verdict(plugin: &str) -> PluginLogVerdict {
    static BUDGETS: OnceLock<std::sync::Mutex<std::collections::HashMap<String, PluginLogBudget>>> =
        OnceLock::new();
    let mut budgets = BUDGETS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let key = if budgets.contains_key(plugin) || budgets.len() < PLUGIN_LOG_NAMES_MAX {
        plugin
    } else {
        ""
    };
    let now = router_core::log_limit::now_ns();
    let window = u64::try_from(PLUGIN_LOG_WINDOW.as_nanos()).unwrap_or(u64::MAX);
    budgets
        .entry(key.to_owned())
        .or_default()
        .admit(now, window, PLUGIN_LOG_LINES_PER_WINDOW)
}

/// A plugin's log record as one `tracing` event. Every field is [`plugin_text`]: a newline in a
/// plugin's message cannot forge a line of the host's log. At most
/// [`PLUGIN_LOG_LINES_PER_WINDOW`] lines per plugin per [`PLUGIN_LOG_WINDOW`] are written; the
/// host says when it starts dropping a plugin's lines and, in the next window, how many it
/// dropped.
extern "C" fn emit_plugin_log(record: &LogRecord<'_>) {
    let plugin = plugin_text(record.plugin.as_str());
    let plugin = plugin.as_str();
    let verdict = plugin_log_verdict(plugin);
    match verdict {
        PluginLogVerdict::Drop => return,
        PluginLogVerdict::Write { dropped_before } if dropped_before > 0 => tracing::warn!(
            target: "plugin",
            plugin,
            dropped = dropped_before,
            "{dropped_before} log lines of this plugin were not logged in the previous {} s \
             (more than {PLUGIN_LOG_LINES_PER_WINDOW} per window)",
            PLUGIN_LOG_WINDOW.as_secs()
        ),
        _ => {}
    }
    let target = plugin_text(record.target.as_str());
    let target = target.as_str();
    let message = plugin_text(record.message.as_str());
    match record.level {
        LogLevel::ERROR => {
            tracing::error!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        LogLevel::WARN => {
            tracing::warn!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        LogLevel::INFO => {
            tracing::info!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        LogLevel::DEBUG => {
            tracing::debug!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        _ => tracing::trace!(target: "plugin", plugin, plugin_target = target, "{message}"),
    }
    if verdict == PluginLogVerdict::WriteLast {
        tracing::warn!(
            target: "plugin",
            plugin,
            "this plugin wrote {PLUGIN_LOG_LINES_PER_WINDOW} log lines in {} s; its further lines \
             in this window are counted, not logged",
            PLUGIN_LOG_WINDOW.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugin_writes_at_most_its_budget_per_window_and_hears_what_was_dropped() {
        let mut b = PluginLogBudget::default();
        let s = 1_000_000_000;
        assert_eq!(
            b.admit(5, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 0 }
        );
        assert_eq!(
            b.admit(6, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 0 }
        );
        assert_eq!(b.admit(7, 10 * s, 3), PluginLogVerdict::WriteLast);
        for i in 0..50 {
            assert_eq!(b.admit(8 + i, 10 * s, 3), PluginLogVerdict::Drop);
        }
        // The next window: written again, with the count of the previous one.
        assert_eq!(
            b.admit(11 * s, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 50 }
        );
        assert_eq!(
            b.admit(12 * s, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 0 }
        );
    }
}
