//! timer-core: the domain, the wire contract, the `Store`/`Broker`/`Clock` traits and the engine
//! of timer-service. It knows no plugin and no SDK; plugins depend on it, never the reverse.

pub mod broker;
pub mod call;
pub mod clock;
pub mod config;
pub mod control;
pub mod engine;
pub mod error;
pub mod fair;
pub mod model;
pub mod outbound;
pub mod plugin;
pub mod policy;
pub mod recurrence;
pub mod redact;
pub mod store;
pub mod trace;
pub mod wire;

pub use broker::{Broker, Delivery, KeyLimit, OutboundEvent, Undelivered};
pub use call::{Called, Caller};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{EngineConfig, Limits};
pub use control::{Action, Change, HistoryEntry};
pub use engine::{Engine, FiredEvent, Scheduled};
pub use error::{Error, ErrorKind, Result};
pub use model::{
    CancelOutcome, ClaimedTimer, ControlOutcome, Due, Lease, NewTimer, Recurrence, ScheduleOutcome,
    Timer, TimerKey, TimerState, Timestamp,
};
pub use outbound::{Message, MessageMeta, Target};
pub use plugin::{BrokerPlugin, StorePlugin};
pub use store::{
    Backlog, LeaseOwners, LiveInstance, Membership, PageAfter, Release, Settlement,
    SharedAllowances, Store, Take, Taken, TakenOver, TenantBacklog, TenantCounts, TenantSummary,
    TimerControl, TimerFilter, TimerHistory, TimerQueries,
};
pub use trace::{TraceContext, TraceHeaders};
pub use wire::{
    decode_command, decode_schedule, Command, DueTimeReachedEnvelope, Reason, Rejection,
};
