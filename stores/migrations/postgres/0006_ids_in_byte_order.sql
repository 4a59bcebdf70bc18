-- Tenant and timer ids compare byte by byte (collation "C"), whatever the database's locale:
-- the order of list pages and cursors is the same as in SQLite and the in-memory store, and a
-- prefix filter is a range on the primary key (`service_call_id >= prefix AND < the next
-- string after every one with that prefix`), which only byte order makes exact. The indexes on
-- these columns are rebuilt; the rows are not rewritten.
ALTER TABLE timers
    ALTER COLUMN tenant_id TYPE TEXT COLLATE "C",
    ALTER COLUMN service_call_id TYPE TEXT COLLATE "C";
ALTER TABLE timer_history
    ALTER COLUMN tenant_id TYPE TEXT COLLATE "C",
    ALTER COLUMN service_call_id TYPE TEXT COLLATE "C";
