//! The one error type of timer-service: a kind (`Unavailable` is the one a retry can cure), a
//! human context, and the source. Plugins map their SDK errors into it at their boundary.

use std::fmt;

/// What went wrong, in terms a caller can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The configuration is wrong; fix it and start again.
    Config,
    /// A server (database, broker) cannot be reached or refused the request; usually transient.
    Unavailable,
    /// The request conflicts with the current state (e.g. a timer that already fired).
    Conflict,
    /// The input is malformed or breaks a rule.
    Invalid,
    /// The thing asked for does not exist.
    NotFound,
    /// The build or plugin does not support what was asked.
    Unsupported,
    /// A bug or an invariant broken inside the service.
    Internal,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Config => "config",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Invalid => "invalid",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error type shared by the engine and every plugin.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: String,
    source: Option<Source>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Error {
            kind,
            context: context.into(),
            source: None,
        }
    }

    pub fn config(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, context)
    }

    pub fn unavailable(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, context)
    }

    pub fn invalid(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, context)
    }

    pub fn unsupported(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, context)
    }

    pub fn internal(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, context)
    }

    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn context(&self) -> &str {
        &self.context
    }

    /// The message and every source, joined by `: `, on one line (for logs and `last_error`).
    pub fn chain(&self) -> String {
        one_line(self)
    }
}

/// `error` and every source, joined by `: ` on one line; a source whose text only repeats the
/// end of the line so far is left out. [`Error::chain`], and how the binary prints the error it
/// exits with.
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut next = error.source();
    while let Some(source) = next {
        let text = source.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = source.source();
    }
    out
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_joins_sources_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let err = Error::unavailable("cannot reach 127.0.0.1:5432").with_source(io);
        assert_eq!(
            err.chain(),
            "cannot reach 127.0.0.1:5432: connection refused"
        );
        assert_eq!(err.kind(), ErrorKind::Unavailable);
        assert_eq!(Error::invalid("x").kind(), ErrorKind::Invalid);
    }
}
