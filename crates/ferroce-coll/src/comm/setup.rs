//! Making a communicator: the device, the endpoint cards the ranks exchange, the QPs and regions,
//! and splitting one by colour.

use super::*;

/// The ferroce device holding the address this host reaches `master` from.
pub(super) fn device_for(master: SocketAddr) -> Result<ferroce::Device, CollError> {
    let local: IpAddr = if master.ip().is_loopback() {
        master.ip()
    } else {
        let any = if master.is_ipv4() {
            IpAddr::from([0, 0, 0, 0])
        } else {
            IpAddr::from([0u16; 8])
        };
        UdpSocket::bind(SocketAddr::new(any, 0))
            .and_then(|s| s.connect(master).map(|_| s))
            .and_then(|s| s.local_addr())
            .map_err(|e| CollError::NoDevice(format!("a route to {master}: {e}")))?
            .ip()
    };
    let gid = ferroce::gid_of(local);
    ferroce::devices()?
        .into_iter()
        .find(|d| d.gids().iter().any(|g| g.gid == gid))
        .ok_or_else(|| CollError::NoDevice(local.to_string()))
}

/// `n` words from the OS's random source (`/dev/urandom`, which the kernel's `getrandom` also
/// draws from); if it cannot be read, from std's `RandomState`, whose keys the standard library
/// draws from the same source.
pub(super) fn random_words(n: usize) -> Vec<u32> {
    use std::io::Read;
    let mut bytes = vec![0u8; 4 * n];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        use std::hash::{BuildHasher, Hasher};
        let state = std::collections::hash_map::RandomState::new();
        for (i, c) in bytes.chunks_mut(8).enumerate() {
            let mut h = state.build_hasher();
            h.write_usize(i);
            let v = h.finish().to_ne_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub(super) const CARD_HEADER: usize = 8 + 4 + 3 * 20;

pub(super) fn put_region(card: &mut Vec<u8>, r: RemoteRegion) {
    card.extend_from_slice(&r.addr.to_be_bytes());
    card.extend_from_slice(&r.len.to_be_bytes());
    card.extend_from_slice(&r.rkey.to_be_bytes());
}

pub(super) fn get_region(b: &[u8]) -> RemoteRegion {
    let word = |r: std::ops::Range<usize>| b[r].iter().fold(0u64, |a, &x| a << 8 | u64::from(x));
    RemoteRegion {
        addr: word(0..8),
        len: word(8..16),
        rkey: word(16..20) as u32,
    }
}

pub(super) fn region_of(mr: &MemoryRegion) -> RemoteRegion {
    RemoteRegion {
        addr: mr.addr(),
        rkey: mr.rkey(),
        len: mr.len() as u64,
    }
}

impl Communicator {
    /// Joins the job torchrun's environment describes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; see [`RankInfo::from_env`]).
    pub fn from_env(opts: &CommOptions) -> Result<Communicator, CollError> {
        let info = RankInfo::from_env()?;
        let store = Store::join(&info, opts.timeout)?;
        Communicator::with_store(store, info.master, opts)
    }

    /// Connects the ranks of `store` (whose rendezvous is at `master`).
    pub fn with_store(
        mut store: Store,
        master: SocketAddr,
        opts: &CommOptions,
    ) -> Result<Communicator, CollError> {
        let device = match &opts.device {
            Some(name) => ferroce::device_by_name(name)?,
            None => device_for(master)?,
        };
        let (rank, size) = (store.rank(), store.world_size());
        let mut comm =
            Communicator::build(
                rank,
                size,
                &device,
                opts,
                |card| Ok(store.all_gather(card)?),
            )?;
        // Every rank's QPs are ready before anyone sends.
        store.all_gather(&[])?;
        comm.store = Some(store);
        Ok(comm)
    }

    /// Connects rank `rank` of `size` through an exchange the caller provides (another
    /// framework's key-value store, say: torch.distributed's): `exchange(card)` hands this
    /// rank's bytes to every rank and returns every rank's, in rank order; it is called twice
    /// (the cards, then an empty one that tells every rank all QPs are ready). The device is
    /// `opts.device`, else the one holding the address this host reaches `master` from, else
    /// loopback's.
    pub fn with_exchange(
        rank: usize,
        size: usize,
        master: Option<SocketAddr>,
        opts: &CommOptions,
        mut exchange: impl FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String>,
    ) -> Result<Communicator, CollError> {
        if size == 0 || rank >= size {
            return Err(CollError::BadRank { rank, size });
        }
        let device = match (&opts.device, master) {
            (Some(name), _) => ferroce::device_by_name(name)?,
            (None, Some(m)) => device_for(m)?,
            (None, None) => device_for(SocketAddr::from(([127, 0, 0, 1], 0)))?,
        };
        let comm = Communicator::build(rank, size, &device, opts, |card| {
            exchange(card).map_err(CollError::Exchange)
        })?;
        exchange(&[]).map_err(CollError::Exchange)?;
        Ok(comm)
    }

    /// Opens this rank's context and regions, exchanges cards through `exchange` (which returns
    /// every rank's card in rank order) and connects a QP to every other rank.
    pub(super) fn build(
        rank: usize,
        size: usize,
        device: &ferroce::Device,
        opts: &CommOptions,
        exchange: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, CollError>,
    ) -> Result<Communicator, CollError> {
        let mut opts = opts.clone();
        opts.slot_bytes = opts.slot_bytes.max(64);
        opts.slots = opts.slots.max(1);
        let ctx = device.open(&ContextOptions {
            provider: opts.provider,
            capture: None,
            ..ContextOptions::with_port(0)
        })?;
        let pd = ctx.alloc_pd()?;
        let per_peer = 2 * opts.slots + 8;
        let cq = ctx.create_cq((per_peer * 4 + RECV_DEPTH + 16) * size.max(1), None)?;
        let remote_write = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE);
        let inbox = pd.alloc_mr(size * opts.slots * opts.slot_bytes, remote_write)?;
        let credits = WordRegion::alloc(&pd, size, remote_write)?;
        let credit_src = WordRegion::alloc(&pd, size, Access::LOCAL_WRITE)?;
        let headers = WordRegion::alloc(&pd, size * opts.slots, remote_write)?;
        let header_src = WordRegion::alloc(&pd, size * opts.slots, Access::LOCAL_WRITE)?;
        let stage = pd.alloc_mr(
            size * opts.slots * opts.slot_bytes.min(INLINE_BYTES),
            Access::LOCAL_WRITE,
        )?;
        let caps = QpCaps {
            max_send_wr: (4 * opts.slots + 64) as u32,
            max_recv_wr: RECV_DEPTH as u32,
            max_inline_data: INLINE_BYTES as u32,
            ..QpCaps::default()
        };
        let mut qps: Vec<Option<QueuePair>> = Vec::with_capacity(size);
        for r in 0..size {
            qps.push(if r == rank {
                None
            } else {
                Some(pd.create_qp(&QpInitAttr {
                    send_cq: &cq,
                    recv_cq: &cq,
                    caps,
                    srq: None,
                })?)
            });
        }
        // The card: the slot geometry, the inbox and credit regions, then one endpoint per rank
        // (a zero record for itself).
        // Initial PSNs come from the OS's random source, as the drop-in's CM chooses them: a
        // stranger who cannot see the traffic cannot guess where a QP's sequence stands (a
        // PSN derived from the QP number would tell it).
        let mut seeds = random_words(size).into_iter();
        let mut psn = || ferroce::Psn::new(seeds.next().unwrap_or_default() & 0xff_ffff);
        let mut card = Vec::with_capacity(CARD_HEADER + size * ENDPOINT_LEN);
        card.extend_from_slice(&(opts.slot_bytes as u64).to_be_bytes());
        card.extend_from_slice(&(opts.slots as u32).to_be_bytes());
        put_region(&mut card, region_of(&inbox));
        put_region(&mut card, region_of(credits.mr()));
        put_region(&mut card, region_of(headers.mr()));
        let mut locals = Vec::with_capacity(size);
        for q in &qps {
            let e = q.as_ref().map(|q| q.endpoint_info(psn(), None));
            match &e {
                Some(e) => card.extend_from_slice(&e.to_bytes()),
                None => card.extend_from_slice(&[0u8; ENDPOINT_LEN]),
            }
            locals.push(e);
        }
        let cards = exchange(&card)?;
        let mut links = Vec::with_capacity(size);
        for (r, (q, local)) in qps.into_iter().zip(locals).enumerate() {
            let (Some(qp), Some(local)) = (q, local) else {
                links.push(None);
                continue;
            };
            let c = cards.get(r).map(Vec::as_slice).unwrap_or_default();
            let want = CARD_HEADER + size * ENDPOINT_LEN;
            if c.len() < want {
                return Err(CollError::BadCard(
                    r,
                    format!("{} bytes, {want} expected", c.len()),
                ));
            }
            let slot_bytes = u64::from_be_bytes(c[0..8].try_into().unwrap_or_default());
            let slots = u32::from_be_bytes([c[8], c[9], c[10], c[11]]);
            if slot_bytes != opts.slot_bytes as u64 || slots as usize != opts.slots {
                return Err(CollError::BadCard(
                    r,
                    format!(
                        "{slots} slots of {slot_bytes} bytes, this rank uses {} of {}",
                        opts.slots, opts.slot_bytes
                    ),
                ));
            }
            let inbox_of = get_region(&c[12..32]);
            let credits_of = get_region(&c[32..52]);
            let headers_of = get_region(&c[52..72]);
            let area = (opts.slots * opts.slot_bytes) as u64;
            let at = CARD_HEADER + rank * ENDPOINT_LEN;
            let peer = EndpointInfo::from_bytes(&c[at..at + ENDPOINT_LEN])
                .map_err(|e| CollError::BadCard(r, e.to_string()))?;
            if inbox_of.len < area * size as u64
                || credits_of.len < 8 * size as u64
                || headers_of.len < 8 * (size * opts.slots) as u64
            {
                return Err(CollError::BadCard(r, "regions too small".into()));
            }
            qp.connect(&local, &peer, &ConnectOptions::default())?;
            for i in 0..RECV_DEPTH {
                qp.post_recv(RecvWr {
                    wr_id: i as u64,
                    sgl: vec![],
                })?;
            }
            links.push(Some(Link {
                qp,
                slots: RemoteRegion {
                    addr: inbox_of.addr + area * rank as u64,
                    len: area,
                    rkey: inbox_of.rkey,
                },
                credit: RemoteRegion {
                    addr: credits_of.addr + 8 * rank as u64,
                    len: 8,
                    rkey: credits_of.rkey,
                },
                headers: RemoteRegion {
                    addr: headers_of.addr + (8 * opts.slots * rank) as u64,
                    len: 8 * opts.slots as u64,
                    rkey: headers_of.rkey,
                },
                sent: 0,
                done: 0,
                reads_until: 0,
                consumed: 0,
                credited: 0,
                arrived: VecDeque::new(),
                posted: RECV_DEPTH,
                failed: None,
                maps: None,
                map_failures: 0,
                involved: false,
                base: 0,
                outq: VecDeque::new(),
                inq: VecDeque::new(),
            }));
        }
        Ok(Communicator {
            rank,
            size,
            store: None,
            opts,
            links,
            inbox,
            credits,
            credit_src,
            headers,
            header_src,
            stage,
            oversubscribed: false,
            cores: std::thread::available_parallelism().map_or(1, |c| c.get()),
            runs: 0,
            cq,
            _pd: pd,
            ctx,
            broken: None,
            in_flight: Default::default(),
            aborted: Default::default(),
        })
    }

    /// Splits the communicator by colour, as `MPI_Comm_split` and `ncclCommSplit` do: every
    /// rank calls it; the ranks passing the same `color` form a new communicator, ranked by
    /// `key` (ties by their rank here). A rank passing `None` takes part in the exchange and
    /// gets `None`. The new communicator has its own QPs and regions; this one stays usable.
    pub fn split(
        &mut self,
        color: Option<u32>,
        key: u32,
    ) -> Result<Option<Communicator>, CollError> {
        let n = self.size;
        let mut mine = [0u8; 16];
        mine[..8].copy_from_slice(&color.map_or(u64::MAX, u64::from).to_le_bytes());
        mine[8..12].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 16 * n];
        self.allgather(&mine, &mut all)?;
        let color_of = |r: usize| u64::from_le_bytes(all[16 * r..16 * r + 8].try_into().unwrap());
        let key_of =
            |r: usize| u32::from_le_bytes(all[16 * r + 8..16 * r + 12].try_into().unwrap());
        let mut group: Vec<usize> = match color {
            Some(_) => (0..n)
                .filter(|&r| color_of(r) == color_of(self.rank))
                .collect(),
            None => Vec::new(),
        };
        group.sort_by_key(|&r| (key_of(r), r));
        // Every rank hands in a card of the largest size, so that one allgather carries them.
        let card_len = 4 + CARD_HEADER + n * ENDPOINT_LEN;
        let device = self.ctx.device().clone();
        let opts = self.opts.clone();
        let new_rank = group.iter().position(|&r| r == self.rank);
        let sub = match new_rank {
            Some(new_rank) => {
                let comm = Communicator::build(new_rank, group.len(), &device, &opts, |card| {
                    let mut padded = vec![0u8; card_len];
                    padded[..4].copy_from_slice(&(card.len() as u32).to_le_bytes());
                    padded[4..4 + card.len()].copy_from_slice(card);
                    let mut cards = vec![0u8; card_len * n];
                    self.allgather(&padded, &mut cards)?;
                    let of = |r: usize| {
                        let c = &cards[card_len * r..card_len * (r + 1)];
                        let len = (u32::from_le_bytes(c[..4].try_into().unwrap()) as usize)
                            .min(card_len - 4);
                        c[4..4 + len].to_vec()
                    };
                    Ok(group.iter().map(|&r| of(r)).collect())
                })?;
                Some(comm)
            }
            None => {
                let mut cards = vec![0u8; card_len * n];
                self.allgather(&vec![0u8; card_len], &mut cards)?;
                None
            }
        };
        // Every new QP is ready before anyone sends on it.
        self.barrier()?;
        Ok(sub)
    }
}

#[cfg(test)]
mod tests {
    use super::random_words;

    #[test]
    fn initial_psns_are_random_not_derived_from_the_qp_number() {
        // Two draws of 8 words agree with probability 2^-256; the old PSNs were a function of
        // the QP number, the same in every job.
        let (a, b) = (random_words(8), random_words(8));
        assert_eq!((a.len(), b.len()), (8, 8));
        assert_ne!(a, b);
        assert!(a.iter().any(|&w| w & 0xff_ffff != a[0] & 0xff_ffff));
    }
}
