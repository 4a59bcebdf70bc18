-- Rate allowances shared by every instance on this schema (limits.rate.shared): one row per
-- kind ('rate': schedules, 'fire': fires) and tenant, holding the theoretical arrival time (TAT)
-- of a generic cell rate algorithm in microseconds since the epoch. A missing row is a full
-- allowance; rows whose time has passed are deleted now and then.
CREATE TABLE timer_allowances (
    kind      TEXT   NOT NULL,
    tenant_id TEXT   COLLATE "C" NOT NULL,
    tat       BIGINT NOT NULL,
    PRIMARY KEY (kind, tenant_id)
);

-- Takes up to p_n cells of p_cell microseconds from an allowance at p_now, atomically (the row
-- is locked): as many as keep its TAT at most p_max_ahead past now (all p_n when p_max_ahead is
-- NULL: reserved turns), or none unless all fit when p_all. Returns how many were taken, the
-- TAT they started from (at least now) and the TAT after.
CREATE FUNCTION timer_allowance_take(p_kind TEXT, p_tenant TEXT, p_now BIGINT, p_cell BIGINT,
                                     p_n BIGINT, p_max_ahead BIGINT, p_all BOOLEAN)
RETURNS TABLE (taken BIGINT, start_at BIGINT, tat_after BIGINT)
LANGUAGE plpgsql AS $$
DECLARE
    v_tat BIGINT;
    v_start BIGINT;
    v_k BIGINT;
BEGIN
    INSERT INTO timer_allowances (kind, tenant_id, tat) VALUES (p_kind, p_tenant, p_now)
        ON CONFLICT DO NOTHING;
    SELECT a.tat INTO v_tat FROM timer_allowances a
        WHERE a.kind = p_kind AND a.tenant_id = p_tenant FOR UPDATE;
    v_start := GREATEST(v_tat, p_now);
    IF p_max_ahead IS NULL THEN
        v_k := p_n;
    ELSE
        v_k := LEAST(p_n, GREATEST(0, (p_now + p_max_ahead - v_start) / p_cell));
        IF p_all AND v_k < p_n THEN
            v_k := 0;
        END IF;
    END IF;
    IF v_k > 0 THEN
        UPDATE timer_allowances a SET tat = v_start + v_k * p_cell
            WHERE a.kind = p_kind AND a.tenant_id = p_tenant;
    END IF;
    RETURN QUERY SELECT v_k, v_start, v_start + v_k * p_cell;
END
$$;
