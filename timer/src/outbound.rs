//! What a fire sends where, when the timer says so: its [`Target`] (a destination of the
//! broker's own in place of the events destination) and its [`Message`] (the producer's own
//! bytes in place of the `DueTimeReached` envelope). The engine stores and passes both on; only
//! the broker plugin reads a target ([`Broker::check_target`](crate::Broker::check_target)).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Where a timer's fires go, in the configured broker's own terms: a JSON object such as
/// `{"subject": "orders.due"}` (NATS), `{"exchange": "orders", "routingKey": "due.eu"}`
/// (RabbitMQ) or `{"topic": "orders", "key": "o-42"}` (Kafka). The broker plugin checks it at
/// admission and reads it when it publishes; the engine only keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target(Map<String, Value>);

impl Target {
    /// A target of these fields.
    pub fn new(fields: Map<String, Value>) -> Self {
        Target(fields)
    }

    /// Its fields, as the command gave them.
    pub fn fields(&self) -> &Map<String, Value> {
        &self.0
    }

    /// The field `name` when it is a string.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.0.get(name).and_then(Value::as_str)
    }

    /// The JSON object text a store keeps.
    pub fn to_json(&self) -> String {
        Value::Object(self.0.clone()).to_string()
    }

    /// Reads back what [`Target::to_json`] wrote.
    pub fn from_json(text: &str) -> Result<Self> {
        match serde_json::from_str(text) {
            Ok(Value::Object(fields)) => Ok(Target(fields)),
            Ok(_) => Err(Error::internal("stored target is not a JSON object")),
            Err(e) => Err(Error::internal(format!("stored target is not JSON: {e}"))),
        }
    }
}

/// The producer's own message, published byte-exact at the due time in place of the envelope:
/// its body, and the content type and headers the broker carries beside it (NATS headers, AMQP
/// properties and headers, Kafka headers). The event id still goes along in the broker's
/// de-duplication slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub body: Vec<u8>,
    pub meta: MessageMeta,
}

/// What goes with a [`Message`]'s body; stored as JSON beside the body's bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MessageMeta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl MessageMeta {
    /// The JSON text a store keeps.
    pub fn to_json(&self) -> String {
        // A struct of strings always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads back what [`MessageMeta::to_json`] wrote.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text)
            .map_err(|e| Error::internal(format!("stored message meta is not readable: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_metas_read_back_what_they_wrote() {
        let Value::Object(fields) = serde_json::json!({"topic": "orders", "partition": 3}) else {
            unreachable!("an object")
        };
        let target = Target::new(fields);
        assert_eq!(Target::from_json(&target.to_json()).unwrap(), target);
        assert_eq!(target.text("topic"), Some("orders"));
        assert_eq!(target.text("partition"), None);
        assert!(Target::from_json("[1]").is_err());

        let meta = MessageMeta {
            content_type: Some("text/plain".into()),
            headers: [("a".to_owned(), "1".to_owned())].into(),
        };
        assert_eq!(MessageMeta::from_json(&meta.to_json()).unwrap(), meta);
        assert_eq!(MessageMeta::default().to_json(), "{}");
    }
}
