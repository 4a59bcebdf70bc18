//! W3C trace context ([Trace Context](https://www.w3.org/TR/trace-context/)): the `traceparent`
//! and `tracestate` a command arrived with, kept with its timer and sent with every fire, so the
//! request that scheduled a timer and the consumer that handles its fire hours later are one
//! trace.
//!
//! Where a context comes from, first found wins: the command's own `traceparent` field (inside
//! an envelope's `payload`, else the envelope's), then the transport's headers (HTTP, NATS,
//! AMQP, Kafka: [`TraceHeaders`]), else a fresh trace ([`TraceContext::fresh`]). A malformed
//! value is never a rejection: it is ignored, logged the first time and counted
//! (`timer.trace_context.ignored`, labelled by where it came from).

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// The header (and field) name of a trace's parent.
pub const TRACEPARENT: &str = "traceparent";
/// The header (and field) name of the vendors' trace state.
pub const TRACESTATE: &str = "tracestate";

/// Where a `tracestate` is cut: the W3C limit a vendor must at least pass on.
const MAX_TRACESTATE: usize = 512;

/// A checked trace context: a `traceparent` of version `00` (a later version is read by its
/// first four fields, as the recommendation asks, and passed on as `00`), and the
/// `tracestate` that came with it, if any.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

/// The trace context headers a command arrived with, as the transport carried them: not yet
/// checked ([`TraceContext::carried`] does that).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// Picks `traceparent` and `tracestate` out of headers (names compared without case); a
    /// header given twice counts by its first value.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut found = TraceHeaders::default();
        for (name, value) in pairs {
            let slot = if name.eq_ignore_ascii_case(TRACEPARENT) {
                &mut found.traceparent
            } else if name.eq_ignore_ascii_case(TRACESTATE) {
                &mut found.tracestate
            } else {
                continue;
            };
            if slot.is_none() {
                *slot = Some(value.to_owned());
            }
        }
        found
    }

    pub fn is_empty(&self) -> bool {
        self.traceparent.is_none() && self.tracestate.is_none()
    }
}

/// Why a trace context was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TraceContext {
    /// Checks a `traceparent` (and its `tracestate`: one that is not a list of `key=value`
    /// members is dropped, the parent kept; one over 512 bytes is cut at a member boundary).
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Result<Self, Malformed> {
        let traceparent = parse_traceparent(traceparent.trim())?;
        Ok(TraceContext {
            traceparent,
            tracestate: tracestate.and_then(checked_tracestate),
        })
    }

    /// A new trace: random ids, marked sampled (a consumer that samples by its parent records
    /// its part; see the tracing page of the book).
    pub fn fresh() -> Self {
        // Not for secrecy: ids need only be unlikely to meet, and this runs per schedule.
        let trace = fastrand::u128(1..);
        let span = fastrand::u64(1..);
        TraceContext {
            traceparent: format!("00-{trace:032x}-{span:016x}-01"),
            tracestate: None,
        }
    }

    /// The context of `headers`, when they carry a well-formed one; a malformed one is
    /// ignored (see [`ignored`]) with `source` naming where it came from.
    pub fn carried(headers: &TraceHeaders, source: &'static str) -> Option<Self> {
        let traceparent = headers.traceparent.as_deref()?;
        match TraceContext::parse(traceparent, headers.tracestate.as_deref()) {
            Ok(context) => Some(context),
            Err(why) => {
                ignored(source, traceparent, &why);
                None
            }
        }
    }

    /// Reads back what a store kept (checked again: a row is outside input too).
    pub fn from_stored(traceparent: Option<&str>, tracestate: Option<&str>) -> Option<Self> {
        TraceContext::parse(traceparent?, tracestate).ok()
    }

    /// `00-<trace id>-<parent id>-<flags>`, lowercase.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The 32 hex digits of the trace id.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The 16 hex digits of the parent (span) id.
    pub fn parent_id(&self) -> &str {
        &self.traceparent[36..52]
    }

    /// Whether the parent marked the trace sampled (the flags' lowest bit).
    pub fn sampled(&self) -> bool {
        self.flags() & 0x01 == 0x01
    }

    fn flags(&self) -> u8 {
        // Checked when made: two hex digits.
        u8::from_str_radix(&self.traceparent[53..55], 16).unwrap_or(0)
    }

    /// As an OpenTelemetry parent from elsewhere (remote): what a span of the engine continues.
    pub fn span_context(&self) -> SpanContext {
        let (trace, parent) = (self.trace_id(), self.parent_id());
        let flags = self.flags();
        SpanContext::new(
            TraceId::from_hex(trace).unwrap_or(TraceId::INVALID),
            SpanId::from_hex(parent).unwrap_or(SpanId::INVALID),
            TraceFlags::new(flags),
            true,
            self.tracestate
                .as_deref()
                .and_then(|state| TraceState::from_str(state).ok())
                .unwrap_or_default(),
        )
    }

    /// The context of a span (its trace, its id as the parent, its flags and trace state);
    /// `None` for the invalid context of a span that records nothing anywhere.
    pub fn of_span(span: &SpanContext) -> Option<Self> {
        if !span.is_valid() {
            return None;
        }
        let state = span.trace_state().header();
        Some(TraceContext {
            traceparent: format!(
                "00-{}-{}-{:02x}",
                span.trace_id(),
                span.span_id(),
                span.trace_flags().to_u8()
            ),
            tracestate: (!state.is_empty()).then_some(state),
        })
    }

    /// The headers that carry it: `traceparent`, then `tracestate` when there is one.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        std::iter::once((TRACEPARENT, self.traceparent.as_str()))
            .chain(self.tracestate.as_deref().map(|state| (TRACESTATE, state)))
    }
}

fn parse_traceparent(text: &str) -> Result<String, Malformed> {
    let bad = |why: &str| Malformed(format!("{why} (expected 00-<32 hex>-<16 hex>-<2 hex>)"));
    let fields: Vec<&str> = text.split('-').collect();
    let [version, trace, parent, flags, rest @ ..] = fields.as_slice() else {
        return Err(bad("fewer than four fields"));
    };
    let lower_hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !lower_hex(version, 2) || *version == "ff" {
        return Err(bad(
            "the version is not two lowercase hex digits other than ff",
        ));
    }
    // Version 00 has exactly four fields; a later version may add fields after them.
    if *version == "00" && !rest.is_empty() {
        return Err(bad("version 00 has four fields"));
    }
    if !lower_hex(trace, 32) || trace.bytes().all(|b| b == b'0') {
        return Err(bad(
            "the trace id is not 32 lowercase hex digits, not all zero",
        ));
    }
    if !lower_hex(parent, 16) || parent.bytes().all(|b| b == b'0') {
        return Err(bad(
            "the parent id is not 16 lowercase hex digits, not all zero",
        ));
    }
    let Some(flags) = lower_hex(flags, 2)
        .then(|| u8::from_str_radix(flags, 16).ok())
        .flatten()
    else {
        return Err(bad("the flags are not two lowercase hex digits"));
    };
    // Passed on as version 00, whose defined flags are sampled (0x01) and random (0x02): the
    // others are set to zero, as the recommendation asks.
    Ok(format!("00-{trace}-{parent}-{:02x}", flags & 0x03))
}

/// A `tracestate` to pass on: its members when each is `key=value` as W3C Trace Context says
/// ([`tracestate_key`], values of 1 to 256 printable characters but `,` and `=`, not ending in a
/// space; empty members dropped), at most 32 of them and 512 bytes (the last members cut
/// first); `None` when none is left, one member is not of that form, or a key comes twice (a
/// tracer would refuse the list, and drop every vendor's entry with it).
fn checked_tracestate(text: &str) -> Option<String> {
    let mut kept = String::new();
    let mut keys = std::collections::HashSet::new();
    for (n, member) in text
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .enumerate()
    {
        let (key, value) = member.split_once('=')?;
        let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b',');
        if !tracestate_key(key) || !keys.insert(key) {
            return None;
        }
        if value.is_empty() || value.len() > 256 || !printable(value) || value.contains('=') {
            return None;
        }
        if value.ends_with(' ') {
            return None;
        }
        if n >= 32 || kept.len() + member.len() + 1 > MAX_TRACESTATE {
            break;
        }
        if !kept.is_empty() {
            kept.push(',');
        }
        kept.push_str(member);
    }
    (!kept.is_empty()).then_some(kept)
}

/// A `tracestate` key: `lcalpha *( lcalpha / DIGIT / "_" / "-" / "*" / "/" )` of at most 256,
/// or `tenant@system` (a tenant of at most 241 starting with a letter or digit, a system of at
/// most 14 starting with a letter).
fn tracestate_key(key: &str) -> bool {
    let part = |s: &str, max: usize, first_digit: bool| {
        let bytes = s.as_bytes();
        (1..=max).contains(&bytes.len())
            && (bytes[0].is_ascii_lowercase() || (first_digit && bytes[0].is_ascii_digit()))
            && bytes[1..].iter().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'_' | b'-' | b'*' | b'/')
            })
    };
    match key.split_once('@') {
        None => part(key, 256, false),
        Some((tenant, system)) => part(tenant, 241, true) && part(system, 14, false),
    }
}

/// The first ignored context is logged (a warning naming where it came from and why); each is
/// counted in `timer.trace_context.ignored` by `source`.
pub fn ignored(source: &'static str, value: &str, why: &Malformed) {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    metrics::counter!(crate::engine::metrics::TRACE_CONTEXT_IGNORED, "source" => source)
        .increment(1);
    if !LOGGED.swap(true, Ordering::Relaxed) {
        let value: String = value.chars().take(80).collect();
        tracing::warn!(
            source,
            traceparent = %value,
            "a malformed traceparent was ignored: {why}; the timer gets a fresh trace (logged \
             once; timer.trace_context.ignored counts them)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_well_formed_traceparent_is_kept_as_it_came() {
        let context =
            TraceContext::parse(GOOD, Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")).unwrap();
        assert_eq!(context.traceparent(), GOOD);
        assert_eq!(context.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(context.parent_id(), "00f067aa0ba902b7");
        assert!(context.sampled());
        assert_eq!(
            context.tracestate(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );
        let headers: Vec<_> = context.headers().collect();
        assert_eq!(headers.len(), 2);
    }

    #[test]
    fn malformed_traceparents_are_refused_with_a_reason() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let why = TraceContext::parse(bad, None).unwrap_err();
            assert!(why.0.contains("expected 00-"), "{bad:?}: {why}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_fields_and_passed_on_as_00() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes";
        let context = TraceContext::parse(later, None).unwrap();
        assert_eq!(context.traceparent(), GOOD);
    }

    #[test]
    fn sampled_is_the_lowest_flag_bit_and_unknown_bits_are_cleared() {
        let with = |flags: &str| {
            TraceContext::parse(
                &format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"),
                None,
            )
            .unwrap()
        };
        assert!(with("09").sampled());
        assert!(!with("02").sampled());
        assert!(with("ff").traceparent().ends_with("-03"));
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-f9-x";
        assert!(TraceContext::parse(later, None)
            .unwrap()
            .traceparent()
            .ends_with("-01"));
    }

    #[test]
    fn a_bad_tracestate_is_dropped_and_a_long_one_cut() {
        let context = TraceContext::parse(GOOD, Some("no equals sign")).unwrap();
        assert_eq!(context.tracestate(), None);
        // Keys and values as W3C Trace Context has them; a list with one wrong is dropped.
        for good in [
            "congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7,1tenant@sys_1=x y",
        ] {
            let context = TraceContext::parse(GOOD, Some(good)).unwrap();
            assert_eq!(context.tracestate(), Some(good));
        }
        let long_value = format!("k={}", "v".repeat(257));
        for bad in [
            "Foo Bar=1",
            "UPPER=x",
            "a@b@c=1",
            "1abc=x",
            "a=1,a=2",
            "k=",
            long_value.as_str(),
        ] {
            let context = TraceContext::parse(GOOD, Some(bad)).unwrap();
            assert_eq!(context.tracestate(), None, "{bad}");
        }
        let long: Vec<String> = (0..40)
            .map(|n| format!("k{n}={}", "v".repeat(20)))
            .collect();
        let context = TraceContext::parse(GOOD, Some(&long.join(","))).unwrap();
        let kept = context.tracestate().unwrap();
        assert!(kept.len() <= MAX_TRACESTATE, "{kept}");
        assert!(kept.starts_with("k0="));
        let many: Vec<String> = (0..40).map(|n| format!("k{n}=v")).collect();
        let context = TraceContext::parse(GOOD, Some(&many.join(","))).unwrap();
        assert_eq!(context.tracestate().unwrap().split(',').count(), 32);
    }

    #[test]
    fn a_context_is_the_same_as_a_span_context() {
        let context = TraceContext::parse(GOOD, Some("congo=t61rcWkgMzE")).unwrap();
        let span = context.span_context();
        assert!(span.is_valid() && span.is_remote() && span.is_sampled());
        assert_eq!(TraceContext::of_span(&span), Some(context));
        assert_eq!(TraceContext::of_span(&SpanContext::empty_context()), None);
    }

    #[test]
    fn fresh_contexts_are_well_formed_and_differ() {
        let (a, b) = (TraceContext::fresh(), TraceContext::fresh());
        assert_ne!(a.trace_id(), b.trace_id());
        assert_eq!(TraceContext::parse(a.traceparent(), None).unwrap(), a);
        assert!(a.sampled());
    }

    #[test]
    fn headers_are_found_without_case_and_first_wins() {
        let found = TraceHeaders::from_pairs([
            ("TraceParent", GOOD),
            ("traceparent", "second"),
            ("other", "x"),
        ]);
        assert_eq!(found.traceparent.as_deref(), Some(GOOD));
        assert_eq!(found.tracestate, None);
        let context = TraceContext::carried(&found, "test").unwrap();
        assert_eq!(context.traceparent(), GOOD);
        let bad = TraceHeaders {
            traceparent: Some("garbage".into()),
            tracestate: None,
        };
        assert_eq!(TraceContext::carried(&bad, "test"), None);
    }
}
