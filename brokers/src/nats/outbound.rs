//! What a fire sends: a target's subject (never the service's own, nor the server's), the
//! headers of an event or a timer's own message, and whether a stream refused it.

use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, context::PublishErrorKind};
use timer_core::{OutboundEvent, Target};

/// The subject of a target `{"subject": "..."}`, when it is one this broker may publish to: a
/// subject without wildcards that fits the protocol line, and none the service uses itself.
pub(super) fn target_subject<'t>(
    target: &'t Target,
    own: &[String],
) -> std::result::Result<&'t str, String> {
    let subject = match (target.text("subject"), target.fields().len()) {
        (Some(subject), 1) => subject,
        _ => {
            return Err(format!(
                "the nats broker takes a target {{\"subject\": \"orders.due\"}}, not {}",
                target.to_json()
            ))
        }
    };
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(format!(
            "subject is {} bytes; at most {MAX_SUBJECT_BYTES} fit the NATS protocol line",
            subject.len()
        ));
    }
    let tokens: Vec<&str> = subject.split('.').collect();
    if tokens.iter().any(|t| {
        t.is_empty() || *t == "*" || *t == ">" || t.chars().any(|c| c.is_whitespace() || c.is_control())
    }) {
        return Err(format!(
            "{subject:?} is not a subject to publish to: tokens are non-empty, without spaces, \
             and not the wildcards * and >"
        ));
    }
    if let Some(pattern) = own.iter().find(|pattern| subject_matches(pattern, &tokens)) {
        return Err(format!(
            "{subject:?} is a subject of the service itself ({pattern}); a timer cannot send there"
        ));
    }
    // The server's own subjects: `$JS.API.STREAM.PURGE.<stream>` purges a stream (the
    // service's too) when anyone with the service's rights publishes there; `$KV`, `$O`, `$SYS`
    // alike; `_INBOX.` are the replies other clients wait for.
    if subject.starts_with('$') || tokens[0] == "_INBOX" {
        return Err(format!(
            "{subject:?} is a subject of the NATS server or its clients ($JS, $KV, $O, $SYS, \
             _INBOX, ...): a timer cannot send there"
        ));
    }
    Ok(subject)
}

/// Whether a subject (its `tokens`) matches `pattern`, whose tokens may be the wildcards `*`
/// (one token) and a last `>` (one or more).
fn subject_matches(pattern: &str, tokens: &[&str]) -> bool {
    let mut rest = tokens.iter();
    for want in pattern.split('.') {
        if want == ">" {
            return rest.next().is_some();
        }
        match rest.next() {
            Some(token) if want == "*" || want == *token => {}
            _ => return false,
        }
    }
    rest.next().is_none()
}

/// The headers of an event: a timer's own message's headers and content type (as
/// `Content-Type`), its trace context, then `Nats-Msg-Id` (the event id). JetStream's own
/// headers of a message stored before admission refused them ([`is_jetstream_header`]) stay
/// behind: the stream would read them as instructions, and refuse the event.
pub(super) fn headers_of(event: &OutboundEvent) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(meta) = &event.message {
        for (name, value) in meta.headers.iter().filter(|(name, _)| !is_jetstream_header(name)) {
            headers.insert(name.as_str(), value.as_str());
        }
        if let Some(content_type) = &meta.content_type {
            headers.insert(CONTENT_TYPE, content_type.as_str());
        }
    }
    for (name, value) in event.trace_headers() {
        headers.insert(name, value);
    }
    headers.insert(NATS_MESSAGE_ID, event.id.to_string().as_str());
    headers
}

/// Whether a publish failed because the stream answered no to that message (a JetStream API
/// error in its PubAck: full with discard new, a wrong expected sequence, ...), not because the
/// answer did not come (a timeout, a lost connection), which may leave the batch half sent.
pub(super) fn refused_by_the_stream(e: &jetstream::context::PublishError) -> bool {
    match e.kind() {
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => true,
        PublishErrorKind::Other => std::error::Error::source(e)
            .is_some_and(|source| source.downcast_ref::<jetstream::Error>().is_some()),
        _ => false,
    }
}

/// How JetStream's own headers start: instructions to the stream a message is published to
/// (`Nats-Msg-Id`, `Nats-Expected-Stream`, `Nats-Rollup`, ...), never a message's own.
pub(super) const JETSTREAM_HEADERS: &str = "Nats-";

/// Whether `name` is one of JetStream's own headers (compared without case).
pub(super) fn is_jetstream_header(name: &str) -> bool {
    name.get(..JETSTREAM_HEADERS.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(JETSTREAM_HEADERS))
}

/// The header carrying a timer's own message's content type.
pub const CONTENT_TYPE: &str = "Content-Type";

/// Longest event subject this broker publishes to. The server closes a connection whose
/// protocol line (`HPUB <subject> <reply> <sizes>`) is longer than its `max_control_line`
/// (4096 bytes by default): one such event would cut every tenant's publishes off, again and
/// again. What is left of the line holds the reply inbox and the sizes.
pub(super) const MAX_SUBJECT_BYTES: usize = 3_968;

#[cfg(test)]
mod tests {
    use timer_core::Target;

    use super::target_subject;

    fn subject(name: &str) -> Result<String, String> {
        let target = Target::from_json(&serde_json::json!({ "subject": name }).to_string())
            .expect("a target");
        target_subject(&target, &["timer.commands.>".to_owned()]).map(str::to_owned)
    }

    /// Subjects of the server (its JetStream API: a publish to `$JS.API.STREAM.PURGE.X` purges
    /// stream X) and the inboxes of clients are never targets, whatever `targets.allow` says.
    #[test]
    fn the_servers_own_subjects_are_no_targets() {
        assert_eq!(subject("acme.orders"), Ok("acme.orders".to_owned()));
        for name in [
            "$JS.API.STREAM.PURGE.TIMER_COMMANDS",
            "$KV.config.key",
            "$SYS.REQ.SERVER.PING",
            "_INBOX.abc",
            "timer.commands.acme",
        ] {
            assert!(subject(name).is_err(), "{name}");
        }
    }
}
