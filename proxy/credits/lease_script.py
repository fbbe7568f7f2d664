"""The one Lua script every lease exchange runs (leases.py), and its reply.

Redis keeps one hash per key and UTC day. `a:<replica>` is the allowance of each replica (what it
may consume today), `used` their sum; `c:`/`f:` are the replica's cumulative debits and refunds as
last reported (their difference is what it spent), `s:` its last applied request, `t:` when it last
asked, `r:` set while its entry is one another replica restored (below). The script takes the
replica's counters (merging by max, so a report that arrives twice or late changes nothing), grows the
allowance when the replica needs credit, or shrinks it to what was spent when the replica gives its
lease back.

A lost entry (Redis restarted without persistence, DEL, FLUSHALL, an eviction) is rebuilt, never
double-counted: the first replica that had a reply today and finds its own entry missing writes it
back (its allowance, which it may still spend, and its counters), and writes what it last saw of each
other replica whose entry is missing too, marked `r:`. Every replica's entry is written once: a
replica finding its restored entry takes it over with its own word (its allowance and counters), so
the key's usage is the sum of one entry per replica again. Spent usage (`c - f`) is never above what
was served: every figure in it was reported by the replica that spent it. A rebuilt entry may be
short of what its owner was granted after the rebuilder's last reply, so while one is unconfirmed
and its owner active, no credit is granted (verdict -2: retry shortly).
"""

from __future__ import annotations

from typing import Any, NamedTuple

# KEYS: the key's ledger hash for the day, its per-second window, and (off a cluster) the day's hash
#   under its name from before hash tags, renamed to the first on first use so an upgrade loses no usage.
# ARGV: replica, request seq, consumed, refunded, cost (0: no credit wanted), mode (0: credit for a call,
#   1: give the lease back, 2: top the lease up ahead of need: the extra part of a grant alone), daily
#   balance, largest lease, now (s), active window (s), per-second limit (0: none), the replica's
#   allowance, whether it had a reply for the key today (1/0), entry TTL, then what it last saw of each
#   other replica: name, allowance, consumed, refunded, last asked (5 values each).
# Returns {verdict (1 ok, 0 exhausted, -1 rate limited, -2 held: a rebuilt entry unconfirmed, -3 held
#   elsewhere: the balance can pay the call but other replicas' leases hold it), allowance, used,
#   active replicas, restored, spent by all replicas, when a replica last found credit held elsewhere
#   (`w`, s; 0: never), how many times replicas found it so today (`n`: every want is told apart, two in
#   one second too), then the other replicas as the same 5 values each}.
LEASE_SCRIPT = """
local key, me = KEYS[1], ARGV[1]
local seq, consumed, refunded = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, give_back, top_up = tonumber(ARGV[5]), ARGV[6] == '1', ARGV[6] == '2'
local daily, lease_max = tonumber(ARGV[7]), tonumber(ARGV[8])
local now, window, per_second = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local known_allowance, known = tonumber(ARGV[12]), ARGV[13] == '1'
if KEYS[3] and redis.call('EXISTS', key) == 0 and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], key)
end
local h = {}
local flat = redis.call('HGETALL', key)
for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
local fresh = seq > tonumber(h['s:' .. me] or '0')  -- a late duplicate changes no lease
local restored = 0
if known then
  if h['a:' .. me] == nil then
    restored = 1
  end
  if fresh and (h['a:' .. me] == nil or h['r:' .. me]) then
    h['a:' .. me] = known_allowance  -- this replica's own word about its lease
    redis.call('HDEL', key, 'r:' .. me)
  end
  for i = 15, #ARGV, 5 do
    local peer = ARGV[i]
    if h['a:' .. peer] == nil then
      h['a:' .. peer], h['c:' .. peer], h['f:' .. peer] = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
      h['t:' .. peer], h['r:' .. peer] = ARGV[i + 4], '1'
      redis.call('HSET', key, 'a:' .. peer, ARGV[i + 1], 'c:' .. peer, ARGV[i + 2], 'f:' .. peer, ARGV[i + 3],
                 't:' .. peer, ARGV[i + 4], 'r:' .. peer, 1)
      restored = 1
    end
  end
end
local a = tonumber(h['a:' .. me] or '0')
consumed = math.max(consumed, tonumber(h['c:' .. me] or '0'))
refunded = math.max(refunded, tonumber(h['f:' .. me] or '0'))
local net = consumed - refunded
if net > a then a = net end  -- spent while Redis was unreachable (journaled): counted now
local others, spent, active, peers, unconfirmed, held_elsewhere = 0, net, 1, {}, false, 0
for name, value in pairs(h) do
  local kind, who = string.sub(name, 1, 2), string.sub(name, 3)
  if who ~= me then
    if kind == 'a:' then
      local c, f = tonumber(h['c:' .. who] or '0'), tonumber(h['f:' .. who] or '0')
      others = others + tonumber(value)
      spent = spent + c - f
      if tonumber(h['t:' .. who] or '0') > now - window then
        held_elsewhere = held_elsewhere + math.max(tonumber(value) - c + f, 0)  -- unspent, an active replica's
      end
      peers[#peers + 1] = who
      peers[#peers + 1] = tonumber(value)
      peers[#peers + 1] = c
      peers[#peers + 1] = f
      peers[#peers + 1] = tonumber(h['t:' .. who] or '0')
    elseif kind == 't:' and tonumber(value) > now - window then
      active = active + 1
    elseif kind == 'r:' and tonumber(h['t:' .. who] or '0') > now - window then
      -- An entry rebuilt from another replica's last view, not yet confirmed by its active owner,
      -- may hold less than its owner was granted: no credit is granted meanwhile (a call that needs
      -- some hears 'retry shortly'), or two replicas could spend the same credit.
      unconfirmed = true
    end
  end
end
local verdict = 1
if fresh then
  if give_back then a = math.max(net, 0) end
  if cost > 0 then
    local need = math.max(net + cost - a, 0)
    local free = daily - (others + a)
    if unconfirmed and (need > 0 or top_up) and need <= free + held_elsewhere then
      -- (A rebuilt entry only ever shows less than was granted: a balance that cannot pay the call
      -- even so is spent, refused as such below.)
      if need > 0 then verdict = -2 end
    elseif need > free then
      if need <= free + held_elsewhere then
        -- Not spent yet, but held in active replicas' leases: they are asked for it back (`w`, read
        -- at their next exchange) and this replica asks again (verdict -3: held elsewhere). A
        -- replica gone without giving its lease back (not active) is asked nothing.
        verdict = -3
        redis.call('HSET', key, 'w', now)
        h['n'] = redis.call('HINCRBY', key, 'n', 1)
      else
        verdict = 0
      end
    elseif per_second > 0 then
      -- The key's window (rate_window.py, its twin): the second of its latest spending (a call
      -- judged late counts in it), the last second it fills and what it holds of that one; every
      -- second before `last` is full (a call dearer than the limit).
      local w = redis.call('HMGET', KEYS[2], 'start', 'last', 'used')
      local second = math.max(now, tonumber(w[1] or '-1'))
      local last, held = tonumber(w[2] or '-1'), 0
      if second < last then held = per_second elseif second == last then held = tonumber(w[3] or '0') end
      if held > 0 and held + cost > per_second then
        verdict = -1
      else
        local full = math.floor((held + cost) / per_second)
        local rest = held + cost - full * per_second
        if rest == 0 and full > 0 then full, rest = full - 1, per_second end
        redis.call('HSET', KEYS[2], 'start', second, 'last', second + full, 'used', rest)
        redis.call('EXPIRE', KEYS[2], second + full - now + 2)
        a = a + need
      end
    elseif need > 0 or top_up then
      local calls = math.floor((free - need) / (2 * active * cost))
      a = a + need + math.min(calls, math.floor(lease_max / cost)) * cost
    end
  end
  redis.call('HSET', key, 's:' .. me, seq)
end
redis.call('HSET', key, 'used', others + a, 'a:' .. me, a, 'c:' .. me, consumed, 'f:' .. me, refunded, 't:' .. me, now)
redis.call('EXPIRE', key, tonumber(ARGV[14]))
local reply = {verdict, a, others + a, active, restored, spent, tonumber(h['w'] or '0'), tonumber(h['n'] or '0')}
if verdict == -3 then reply[7] = now end
for i = 1, #peers do reply[#reply + 1] = peers[i] end
return reply
"""

PEER_FIELDS = 5  # name, allowance, consumed, refunded, last asked


class LeaseReply(NamedTuple):
    verdict: int  # 1 ok, 0 exhausted, -1 rate limited, -2 held (unconfirmed), -3 held elsewhere
    allowance: int
    used: int  # every replica's allowance: what the balance is judged against
    active: int
    restored: bool
    spent: int  # every replica's debits less refunds: what was served
    wanted: int  # when a replica last found the key's credit held elsewhere (s; 0: never)
    wants: int  # how many times replicas found it so today
    peers: tuple[Any, ...]  # the other replicas, flat, as ARGV takes them back


def parse_reply(reply: list[Any]) -> LeaseReply:
    verdict, allowance, used, active, restored, spent, wanted, wants = (int(v) for v in reply[:8])
    peers = tuple(v.decode() if isinstance(v, bytes) else int(v) for v in reply[8:])
    return LeaseReply(verdict, allowance, used, active, bool(restored), spent, wanted, wants, peers)
