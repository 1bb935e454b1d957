//! The timed loops: the WRITE ping-pong, the other latency tests, and the bandwidth stream.

use std::time::{Duration, Instant};

use ferroce::{RecvWr, SendOp, SendWr};

use super::*;

/// The client's side of the WRITE ping-pong: set the flag, post, read the clock, wait for the
/// answer. Its own loop, apart from the other latency tests: on shared memory the path from
/// seeing the peer's flag to the store of the next WRITE is the whole of what this test
/// measures beyond the line crossing, and every instruction on it (the other tests' arms and
/// their bookkeeping included) is on it once per half round trip.
pub(super) fn write_lat_round(
    s: &Session,
    size: u64,
    iters: u64,
    deadline: Instant,
) -> Res<Vec<u64>> {
    let len = size as usize;
    let mut wr = SendWr::new(0, SendOp::Write, sge(s, s.send_off(0), size)?)
        .remote(s.remote_addr(s.recv_off(0)), s.remote.rkey)
        .flags(unsignaled());
    let looks = flag_looks(s);
    let flag_off = s.recv_off(0) + len - 1;
    let mut tx = s.qps[0].sender();
    let mut tail = FlagWord::new(s, s.send_off(0), len)?;
    let mut laps = Laps::new(iters, false);
    for i in 0..iters {
        let flag = flag_of(i);
        tail.set(s, flag)?;
        wr.wr_id = i;
        tx.post_send(&wr).map_err(|e| e.to_string())?;
        laps.lap();
        wait_flag(s, flag_off, flag, looks, deadline)?;
    }
    laps.lap();
    Ok(laps.samples)
}

/// A latency test's samples: the times between consecutive clock reads, one read per
/// iteration. In the ping-pong tests (WRITE, SEND) the read comes right after the post, while
/// the message is on its way and this side would only wait: each interval is still one whole
/// round trip, but reading the clock is not on the path the peer waits for. (The last interval
/// ends when the last answer arrives, without a post: one sample in `iters`.) The other tests
/// read the clock before the first post and after each completion.
pub(super) struct Laps {
    pub(super) last: Option<Instant>,
    pub(super) samples: Vec<u64>,
}

impl Laps {
    /// Room for `iters` samples, already in memory; the first interval starts now if
    /// `start_now`, else at the first `lap`.
    pub(super) fn new(iters: u64, start_now: bool) -> Laps {
        // Written once before the clock starts: a fresh allocation's pages are only mapped at
        // their first store, and a page fault every 512 samples would land in the samples.
        // (Not with zeros: zeroed memory is asked for as such and comes as untouched pages.)
        let mut samples = vec![u64::MAX; iters as usize];
        samples.clear();
        Laps {
            last: start_now.then(Instant::now),
            samples,
        }
    }

    /// Reads the clock, ending the interval under way (if any) and starting the next.
    pub(super) fn lap(&mut self) {
        let t = Instant::now();
        if let Some(l) = self.last.replace(t) {
            self.samples.push((t - l).as_nanos() as u64);
        }
    }
}

pub(super) fn lat_round(
    args: &PerfArgs,
    s: &Session,
    size: u64,
    iters: u64,
    deadline: Instant,
) -> Res<Vec<u64>> {
    let qp = &s.qps[0];
    let mut last_orig = None;
    // Each test posts the same request every iteration, built once (as perftest does): a post
    // then allocates nothing.
    let mut wr = match args.test {
        Test::WriteLat => return write_lat_round(s, size, iters, deadline),
        Test::SendLat => {
            SendWr::new(0, SendOp::Send, sge(s, s.send_off(0), size)?).flags(unsignaled())
        }
        Test::ReadLat => SendWr::new(0, SendOp::Read, sge(s, s.recv_off(0), size)?)
            .remote(s.remote_addr(s.send_off(0)), s.remote.rkey),
        Test::AtomicLat => SendWr::new(0, SendOp::FetchAdd { add: 1 }, sge(s, s.recv_off(0), 8)?)
            .remote(s.remote_addr(s.counter_off()), s.remote.rkey),
        _ => return Err(format!("{} is not a latency test", test_name(args.test))),
    };
    let mut tx = qp.sender();
    let ping_pong = matches!(args.test, Test::SendLat);
    let mut laps = Laps::new(iters, !ping_pong);
    for i in 0..iters {
        wr.wr_id = i;
        tx.post_send(&wr).map_err(|e| e.to_string())?;
        if ping_pong {
            laps.lap();
            wait_recv(s, deadline)?;
            qp.post_recv(RecvWr {
                wr_id: 0,
                sgl: sge(s, s.recv_off(0), size)?,
            })
            .map_err(|e| e.to_string())?;
            continue;
        }
        wait_send(s, deadline)?;
        if args.verify && matches!(args.test, Test::AtomicLat) {
            let orig = s.buf.read_u64(s.recv_off(0)).map_err(|e| e.to_string())?;
            if orig != i || last_orig.is_some_and(|p| p + 1 != orig) {
                return Err(format!(
                    "verification failed: FETCH_ADD {i} returned {orig}"
                ));
            }
            last_orig = Some(orig);
        }
        laps.lap();
    }
    if ping_pong {
        laps.lap();
    }
    Ok(laps.samples)
}

pub(super) fn bw_round(
    args: &PerfArgs,
    s: &Session,
    size: u64,
    iters: u64,
    deadline: Instant,
) -> Res<Vec<u64>> {
    let nq = s.qps.len();
    let total = iters * nq as u64;
    let depth = u64::from(args.tx_depth);
    let (mut posted, mut done) = (0u64, 0u64);
    let mut times = Vec::with_capacity(total as usize);
    let mut wcs = vec![ferroce::empty_wc(); 64];
    let t0 = Instant::now();
    let wr_for = |n: u64| -> Res<(usize, SendWr)> {
        let q = (n % nq as u64) as usize;
        let wr = match args.test {
            Test::WriteBw => SendWr::new(n, SendOp::Write, sge(s, s.send_off(q), size)?)
                .remote(s.remote_addr(s.recv_off(q)), s.remote.rkey),
            Test::ReadBw => SendWr::new(n, SendOp::Read, sge(s, s.recv_off(q), size)?)
                .remote(s.remote_addr(s.send_off(q)), s.remote.rkey),
            Test::SendBw => SendWr::new(n, SendOp::Send, sge(s, s.send_off(q), size)?),
            _ => SendWr::new(n, SendOp::FetchAdd { add: 1 }, sge(s, s.recv_off(q), 8)?)
                .remote(s.remote_addr(s.counter_off()), s.remote.rkey),
        };
        Ok((q, wr))
    };
    while done < total {
        // Post up to the window, in one doorbell per QP.
        let room = (depth - (posted - done)).min(total - posted);
        if room > 0 {
            let mut per_qp: Vec<Vec<SendWr>> = vec![Vec::new(); nq];
            for _ in 0..room {
                let (q, wr) = wr_for(posted)?;
                per_qp[q].push(wr);
                posted += 1;
            }
            for (q, wrs) in per_qp.into_iter().enumerate() {
                if !wrs.is_empty() {
                    s.qps[q].post_send_batch(wrs).map_err(|e| e.to_string())?;
                }
            }
        }
        let n = s.cq.poll(&mut wcs).map_err(|e| e.to_string())?;
        let now = t0.elapsed().as_nanos() as u64;
        for wc in &wcs[..n] {
            check_wc(wc)?;
            done += 1;
            times.push(now);
        }
        let give_up = deadline + Duration::from_secs(size * total / (50 << 20));
        if n == 0 && Instant::now() > give_up {
            return Err(format!(
                "{} of {total} operations completed before the timeout",
                done
            ));
        }
        if n == 0 {
            // The window is full, or everything is posted: nothing to do until a completion.
            idle_wait(s, give_up)?;
        }
    }
    Ok(times)
}

/// What a timed bandwidth round (`--duration`) delivered.
pub(super) struct TimedBw {
    /// Completion times (ns since the first post) of the messages completed within the window.
    pub(super) times: Vec<u64>,
    /// Messages each QP completed within the window.
    pub(super) per_qp: Vec<u64>,
    /// Messages that completed after the window, while the round drained.
    pub(super) late: u64,
    /// Messages still outstanding when the round stopped waiting for them.
    pub(super) outstanding: u64,
    /// The first failed completion, and how many QPs failed.
    pub(super) failure: Option<(String, usize)>,
}

impl TimedBw {
    /// Whether everything posted completed, successfully.
    pub(super) fn clean(&self) -> bool {
        self.outstanding == 0 && self.failure.is_none()
    }
}

/// A bandwidth round that posts for `window`, each QP keeping `--tx-depth` requests of its
/// own in flight, then waits until `drain_until` at most for the rest. A failed completion
/// stops that QP, not the round: what the others delivered is still reported.
pub(super) fn bw_round_timed(
    args: &PerfArgs,
    s: &Session,
    size: u64,
    window: Duration,
    drain_for: Duration,
) -> Res<TimedBw> {
    let nq = s.qps.len();
    let depth = u64::from(args.tx_depth);
    // One request per QP, built once; the work request id names the QP.
    let wrs = (0..nq)
        .map(|q| {
            Ok(match args.test {
                Test::WriteBw => SendWr::new(q as u64, SendOp::Write, sge(s, s.send_off(q), size)?)
                    .remote(s.remote_addr(s.recv_off(q)), s.remote.rkey),
                _ => SendWr::new(q as u64, SendOp::Read, sge(s, s.recv_off(q), size)?)
                    .remote(s.remote_addr(s.send_off(q)), s.remote.rkey),
            })
        })
        .collect::<Res<Vec<SendWr>>>()?;
    let mut out = TimedBw {
        times: Vec::new(),
        per_qp: vec![0; nq],
        late: 0,
        outstanding: 0,
        failure: None,
    };
    let mut in_flight = vec![0u64; nq];
    let mut failed = vec![false; nq];
    let mut wcs = vec![ferroce::empty_wc(); 64];
    let t0 = Instant::now();
    let end = t0 + window;
    let mut drain_until = None;
    loop {
        let now = Instant::now();
        let posting = now < end;
        if posting {
            for q in 0..nq {
                let room = depth - in_flight[q];
                if failed[q] || room == 0 {
                    continue;
                }
                let batch = std::iter::repeat_with(|| wrs[q].clone()).take(room as usize);
                s.qps[q].post_send_batch(batch).map_err(|e| e.to_string())?;
                in_flight[q] += room;
            }
        }
        let n = s.cq.poll(&mut wcs).map_err(|e| e.to_string())?;
        let at = Instant::now();
        for wc in &wcs[..n] {
            let q = wc.wr_id as usize;
            if q >= nq {
                return Err(format!("a completion names no QP of this run: {wc:?}"));
            }
            in_flight[q] = in_flight[q].saturating_sub(1);
            if let Err(e) = check_wc(wc) {
                if !failed[q] {
                    failed[q] = true;
                    let first = out.failure.take().map_or(e, |(f, _)| f);
                    out.failure = Some((first, failed.iter().filter(|f| **f).count()));
                }
                continue;
            }
            if at <= end {
                out.per_qp[q] += 1;
                out.times.push((at - t0).as_nanos() as u64);
            } else {
                out.late += 1;
            }
        }
        if !posting {
            let outstanding: u64 = in_flight.iter().sum();
            let until = *drain_until.get_or_insert(at + drain_for);
            if outstanding == 0 || at > until {
                out.outstanding = outstanding;
                return Ok(out);
            }
            if n == 0 {
                idle_wait(s, until)?;
            }
        } else if n == 0 {
            // Every QP's window is full (or failed): nothing to post until a completion.
            idle_wait(s, end)?;
        }
    }
}
