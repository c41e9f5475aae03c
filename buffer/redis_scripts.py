"""The Lua scripts the experience queue (buffer/redis_stream.py) runs server-side: each acts on
a set of entries atomically, and all but the claim check first that the calling consumer still
owns them (exactly-once acknowledgement; see redis_stream's docstring)."""

# Ownership check shared by the scripts below: ARGV[first_id..] are ids; one XPENDING over their
# [min, max] range (ARGV[4], ARGV[5]) with this consumer as filter, at most ARGV[6] entries,
# finds the ones it owns; if that reply was cut at the limit, the rest are checked one by one.
# (A lookup per id costs ~3x more server time for a 512-entry batch.)
OWNED = """
local function owned_ids(first_id)
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[5], ARGV[6], ARGV[2])
  local mine = {}
  for _, e in ipairs(p) do mine[e[1]] = true end
  local full = #p >= tonumber(ARGV[6])
  local owned, lost = {}, {}
  for i = first_id, #ARGV do
    local id = ARGV[i]
    if mine[id] or (full and #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) == 1)
    then owned[#owned + 1] = id else lost[#lost + 1] = id end
  end
  return owned, lost
end

-- XCLAIM ids JUSTID (an unpack() in the middle of an argument list passes only its first value)
local function claim_justid(ids)
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(ids) do args[#args + 1] = id end
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
"""

# KEYS: stream, counters, held. ARGV: group, consumer, reason, min, max, limit, ids...
# -> the ids this consumer did not own (not acked, counted as ack_lost). An acked entry is no
# longer held (see HOLD), in the same step: the books never count it twice.
ACK = OWNED + """
local owned, lost = owned_ids(7)
if #owned > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(owned))
  redis.call('XDEL', KEYS[1], unpack(owned))
  redis.call('HINCRBY', KEYS[2], ARGV[3], #owned)
  redis.call('SREM', KEYS[3], unpack(owned))
end
if #lost > 0 then redis.call('HINCRBY', KEYS[2], 'ack_lost', #lost) end
return lost
"""

# KEYS: stream. ARGV: group, consumer, unused, min, max, limit, ids...
# -> the ids still owned, their idle time reset.
RENEW = OWNED + """
local owned, lost = owned_ids(7)
if #owned > 0 then
  claim_justid(owned)
end
return owned
"""

# Entries the learner trained and holds until a checkpoint holds their update (its ack then).
# KEYS: stream, held, learner_version. ARGV: group, consumer, the learner's version, min, max,
# limit, ids... -> the ids still owned: their idle time reset (no reclaim for claim_idle_ms;
# JUSTID: no delivery counted, so no max_deliveries either), each in the held set, and the
# learner's version recorded, in one step with them (the staleness gate reads both at once).
HOLD = OWNED + """
local owned = {}
if #ARGV >= 7 then owned = owned_ids(7) end
if #owned > 0 then
  claim_justid(owned)
  redis.call('SADD', KEYS[2], unpack(owned))
end
redis.call('SET', KEYS[3], ARGV[3])
return owned
"""

# KEYS: stream. ARGV: group, consumer, min idle ms, cursor, count -> {next cursor, ids, ...}.
# JUSTID: the claim alone does not count as a delivery (redis-py would drop the cursor of a
# JUSTID reply, hence a script).
AUTOCLAIM_IDS = """
return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5], 'JUSTID')
"""

# KEYS: stream, dead, counters. ARGV: group, consumer, maxlen, then (id, reason, detail, raw,
# counter)...: counter is the fate's name, dead_lettered (or dead_lettered_foreign)
DEAD_LETTER = """
local n = 0
for i = 4, #ARGV, 5 do
  local id = ARGV[i]
  if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) == 1 then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'id', id, 'reason', ARGV[i + 1],
               'detail', ARGV[i + 2], 'consumer', ARGV[2], 'raw', ARGV[i + 3])
    redis.call('XACK', KEYS[1], ARGV[1], id)
    redis.call('XDEL', KEYS[1], id)
    redis.call('HINCRBY', KEYS[3], ARGV[i + 4], 1)
    n = n + 1
  end
end
return n
"""

# One put chunk, at most once: a client that retries it (its reply lost to a dropped connection,
# say, after the server applied it) must not append the groups twice. Each producer numbers its
# chunks; the stream's hash S:put_seq keeps the last number applied per producer.
# Each entry also carries the stream's marker (KEYS[5], a random token made once per stream),
# which only this script writes: an entry without it came from another client (foreign).
# KEYS: stream, counters, prompt_positions, put_seq, marker. ARGV: producer, seq, group, prompt
# position ('' for none), payload field, producer field, marker field, then the payloads.
# Returns the backlog after it.
PUT = """
local last = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > last then
  local marker = redis.call('GET', KEYS[5]) or ''
  for i = 8, #ARGV do
    redis.call('XADD', KEYS[1], '*', ARGV[5], ARGV[i], ARGV[6], ARGV[1], ARGV[7], marker)
  end
  redis.call('HINCRBY', KEYS[2], 'produced', #ARGV - 7)
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[4]) end
  redis.call('HSET', KEYS[4], ARGV[1], ARGV[2])
end
return redis.call('XLEN', KEYS[1]) - redis.call('XPENDING', KEYS[1], ARGV[3])[1]
"""

# The first entry to carry a group id keeps it; any later entry with that id is a copy (a
# producer that put the group twice). S:group_ids maps each id to its first entry, S:group_order
# lists the ids newest first, so that only the newest ARGV[1] are remembered.
# KEYS: group_ids, group_order. ARGV: how many ids to remember, then (entry id, group id)...
# -> the entry ids that are copies (an entry delivered again is not a copy of itself).
COPIES = """
local copies = {}
for i = 2, #ARGV, 2 do
  local first = redis.call('HGET', KEYS[1], ARGV[i + 1])
  if not first then
    redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i])
    redis.call('LPUSH', KEYS[2], ARGV[i + 1])
  elseif first ~= ARGV[i] then
    copies[#copies + 1] = ARGV[i]
  end
end
for _ = 1, redis.call('LLEN', KEYS[2]) - tonumber(ARGV[1]) do
  redis.call('HDEL', KEYS[1], redis.call('RPOP', KEYS[2]))
end
return copies
"""
