-- GCRA in Redis: what most users run instead of a rate-limit server, written from the
-- formulas of elockd's `throttle` (docs/protocol.md, "Rate limits"), for bench/run.py's
-- throttle rows. Load it with SCRIPT LOAD, call it with
--
--   EVALSHA sha 1 KEY COUNT PERIOD [BURST [COST]]
--
-- COUNT per PERIOD seconds, at most BURST (default COUNT) at once, COST (default 1; 0
-- peeks). The reply is elockd's five fields as integers, redis-cell's order:
--
--   {admitted (1|0), limit, remaining, retry_ms (0 when admitted), reset_ms}
--
-- The key's value is its TAT (theoretical arrival time) in microseconds of Redis's
-- clock (TIME, read inside the script: Redis 7 replicates a script's effects, not the
-- script); it expires once the TAT has passed, as elockd drops a lapsed key.
local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local burst = tonumber(ARGV[3] or '') or count
local cost = tonumber(ARGV[4] or '') or 1
if not count or count < 1 or count % 1 ~= 0 then
  return redis.error_reply('ERR bad COUNT')
end
if not period or period <= 0 then
  return redis.error_reply('ERR bad PERIOD')
end
if burst < 1 or burst % 1 ~= 0 then
  return redis.error_reply('ERR bad burst')
end
if cost < 0 or cost % 1 ~= 0 then
  return redis.error_reply('ERR bad cost')
end
if cost > burst then
  return redis.error_reply('ERR cost above burst')
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2]) -- µs: exact in a double
local interval = period * 1000000 / count -- T, µs per unit of cost
local capacity = burst * interval -- B·T: how far ahead of now the TAT may run
local epsilon = 0.001 -- µs: float rounding, not policy

-- Whole milliseconds, rounded up (a client that sleeps retry ms is admitted).
local function ms(us)
  local whole = math.ceil(us / 1000 - 0.000001)
  if whole < 0 then
    return 0
  end
  return whole
end

local tat = tonumber(redis.call('GET', KEYS[1]) or '') or now
local base = math.max(tat, now)
local new = base + cost * interval
local ahead = new - now
if ahead <= capacity + epsilon then
  local remaining = math.floor((capacity - ahead) / interval + epsilon)
  if cost > 0 then
    -- %.17g: a double's every digit (tostring keeps 14, too few for µs since 1970).
    redis.call('SET', KEYS[1], string.format('%.17g', new), 'PX', ms(ahead))
  end
  return {1, burst, math.max(0, remaining), 0, ms(ahead)}
end
return {0, burst, 0, ms(ahead - capacity), ms(base - now)}
