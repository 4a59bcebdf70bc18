//! The bounds the handlers enforce, written into the OpenAPI document from the constants and
//! limits the handlers check them with: ranges of numbers, lengths and patterns of strings, the
//! words of enums. A client generated from the document then sends only what the server takes
//! (and knows the words of a timer's state it gets back).
//!
//! Lengths count bytes of UTF-8 on the server and characters in JSON Schema: for ASCII, the
//! same (the descriptions say bytes).

use serde_json::{json, Value};
use timer_core::policy::{CatchUp, Overlap, MAX_CATCH_UP_LIMIT};
use timer_core::{Limits, TimerState};

use crate::http::actions::MAX_NOTE_BYTES;
use crate::http::bulk::ACTIONS;
use crate::http::history::MAX_HISTORY_PAGE;
use crate::http::params::{MAX_LIMIT, MAX_NEXT};

/// No control character (what `char::is_control` finds: C0, DEL and C1).
const NO_CONTROL: &str = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$";

/// Epoch milliseconds, or RFC 3339 with an offset.
const TIME: &str = "^(-?[0-9]+|[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2}))$";

/// The outcomes a completion may report.
pub const COMPLETION_OUTCOMES: [&str; 2] = ["succeeded", "failed"];

/// Writes the bounds into `document` (the JSON of the generated document).
pub fn constrain(document: &mut Value, limits: &Limits) {
    let id = json!({
        "minLength": 1,
        "maxLength": limits.max_id_bytes,
        "pattern": NO_CONTROL,
    });
    let states: Vec<String> = TimerState::ALL
        .iter()
        .map(|s| s.as_str().to_ascii_lowercase())
        .collect();
    let state_names: Vec<&str> = TimerState::ALL.iter().map(|s| s.as_str()).collect();
    let overlaps: Vec<&str> = Overlap::ALL.iter().map(|o| o.as_str()).collect();
    let catch_ups: Vec<&str> = CatchUp::ALL.iter().map(|c| c.as_str()).collect();
    let range = |max: usize| json!({ "minimum": 1, "maximum": max });
    if let Some(paths) = document["paths"].as_object_mut() {
        for (path, item) in paths.iter_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for operation in item.values_mut() {
                let Some(parameters) = operation["parameters"].as_array_mut() else {
                    continue;
                };
                let mut takes_ids = false;
                for parameter in parameters {
                    let place = parameter["in"].as_str().unwrap_or_default().to_owned();
                    let name = parameter["name"].as_str().unwrap_or_default().to_owned();
                    let bounds = match (place.as_str(), name.as_str()) {
                        ("path", "tenant" | "id") | ("query", "tenant") => {
                            takes_ids = true;
                            id.clone()
                        }
                        ("query", "limit") if path.ends_with("/history") => range(MAX_HISTORY_PAGE),
                        ("query", "limit") => range(MAX_LIMIT),
                        ("query", "next") => range(MAX_NEXT),
                        ("query", "state") => json!({ "items": { "enum": states } }),
                        ("query", "prefix") => json!({ "pattern": NO_CONTROL }),
                        ("query", "dueAfter" | "dueBefore") => {
                            json!({ "minLength": 1, "pattern": TIME })
                        }
                        _ => continue,
                    };
                    merge(&mut parameter["schema"], bounds);
                }
                // Refused before the handler (`params::check_path_ids`, the event stream).
                if takes_ids && operation["responses"]["400"].is_null() {
                    operation["responses"]["400"] = json!({
                        "description": "A tenant or id that is no id (`invalid_id`, naming it)",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
                    });
                }
            }
        }
    }
    let schemas = &mut document["components"]["schemas"];
    let note = json!({ "maxLength": MAX_NOTE_BYTES });
    let bodies = [
        ("ScheduleTimer", "tenantId", id.clone()),
        ("ScheduleTimer", "serviceCallId", id.clone()),
        ("ScheduleTimer", "correlationId", id),
        ("ScheduleTimer", "maxOccurrences", json!({ "minimum": 1 })),
        ("ScheduleTimer", "overlap", json!({ "enum": overlaps })),
        ("ScheduleTimer", "catchUp", json!({ "enum": catch_ups })),
        (
            "ScheduleTimer",
            "catchUpLimit",
            json!({ "minimum": 1, "maximum": MAX_CATCH_UP_LIMIT }),
        ),
        ("CompleteRequest", "occurrence", json!({ "minimum": 1 })),
        ("Batch", "commands", json!({ "maxItems": limits.max_batch })),
        ("PauseRequest", "note", note.clone()),
        ("BulkRequest", "note", note),
        ("BulkRequest", "action", json!({ "enum": ACTIONS })),
        // Not empty, unlike the list's: a bulk action on "nothing selected" would take all.
        (
            "BulkFilter",
            "prefix",
            json!({ "minLength": 1, "pattern": NO_CONTROL }),
        ),
        (
            "BulkFilter",
            "state",
            json!({ "minItems": 1, "items": { "enum": states } }),
        ),
        (
            "CompleteRequest",
            "outcome",
            json!({ "enum": COMPLETION_OUTCOMES }),
        ),
        // What the service answers: a timer's state is one of the five.
        ("TimerView", "state", json!({ "enum": state_names })),
    ];
    for (schema, property, bounds) in bodies {
        let property = &mut schemas[schema]["properties"][property];
        if property.is_object() {
            merge(property, bounds);
        }
    }
}

/// Adds `bounds`' keys to `schema`, into nested objects (`items`) too. A schema that allows
/// `null` (`"type": ["string", "null"]`) keeps allowing it: `enum` gets `null` added.
fn merge(schema: &mut Value, bounds: Value) {
    let nullable = schema["type"]
        .as_array()
        .is_some_and(|types| types.iter().any(|t| t == "null"));
    let (Some(target), Value::Object(bounds)) = (schema.as_object_mut(), bounds) else {
        return;
    };
    for (key, mut value) in bounds {
        if key == "enum" && nullable {
            if let Some(words) = value.as_array_mut() {
                words.push(Value::Null);
            }
        }
        match target.get_mut(&key) {
            Some(existing) if existing.is_object() && value.is_object() => merge(existing, value),
            _ => {
                target.insert(key, value);
            }
        }
    }
}
