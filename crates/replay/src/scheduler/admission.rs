//! Admission, prefill and retraction: what admission reserves for decoding
//! ([`DecodeEstimate`], modelled on the reference engine's `new_token_ratio`, and the
//! verify rows of speculating requests), admitting waiting requests against the prefix
//! cache, prefill chunks, and retracting the newest request when memory is short.

use super::{Running, Simulation, Waiting};
use crate::error::ReplayError;

/// What admission reserves for decoding, as the reference engine's scheduler does
/// (SGLang's `new_token_ratio`: `NewTokenRatioTracker` and `retract_decode`): a new
/// request reserves its whole remaining output, each running request the expected share
/// of its own (`ratio` × remaining, both clipped at [`DecodeEstimate::CLIP`]). The ratio
/// starts at 0.7, decays over 600 decode steps without a retraction to 0.7 × 0.14, and a
/// retraction resets it to what the remaining batch has decoded so far (plus 20 steps
/// each) over what it may decode. Deterministic: no clock or randomness.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct DecodeEstimate {
    ratio: f64,
}

impl DecodeEstimate {
    const INIT: f64 = 0.7;
    const MIN: f64 = Self::INIT * 0.14;
    const DECAY: f64 = (Self::INIT - Self::MIN) / 600.0;
    /// Longest output an estimate counts.
    const CLIP: usize = 4096;
    /// Steps of decode a retraction's new estimate grants each remaining request.
    const RETRACT_DECODE_STEPS: u64 = 20;

    pub(super) fn new() -> Self {
        DecodeEstimate { ratio: Self::INIT }
    }

    /// Tokens a request with `left` output tokens to go reserves at its admission.
    fn admitting(left: usize) -> usize {
        left.min(Self::CLIP)
    }

    /// Tokens a running request with `left` output tokens to go keeps reserved.
    fn running(&self, left: usize) -> usize {
        (left.min(Self::CLIP) as f64 * self.ratio).ceil() as usize
    }

    /// A decode step went by without a retraction.
    pub(super) fn decay(&mut self) {
        self.ratio = (self.ratio - Self::DECAY).max(Self::MIN);
    }

    /// After a retraction: the remaining batch has decoded `decoded` of at most `max_new`
    /// tokens over `requests` requests.
    fn retracted(&mut self, decoded: u64, max_new: u64, requests: usize) {
        let expected = decoded + Self::RETRACT_DECODE_STEPS * requests as u64;
        self.ratio = (expected as f64 / (max_new + 1) as f64).min(1.0);
    }
}

impl Simulation<'_> {
    /// Admits waiting requests in order while the concurrency cap, the prefill budget and
    /// memory allow, and prefills their first chunk.
    pub(super) fn admit(&mut self, budget: &mut usize) -> Result<bool, ReplayError> {
        let mut admitted = false;
        while self.running.len() < self.workload.concurrency as usize && *budget > 0 {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let spec = &self.workload.requests[w.spec];
            let output_left = (spec.output_len - w.sampled.min(spec.output_len)) as usize;
            let hit = self.cache.match_prefix(w.tokens);
            let reserve = DecodeEstimate::admitting(output_left)
                + self.running_reserve()
                + self.verify_reserve();
            if !self.cache.can_admit(&hit, reserve) {
                if self.running.is_empty() {
                    // Nothing else holds memory: clear the prefix cache and try once more,
                    // else this request can never run.
                    let len = hit.prompt_len();
                    self.cache.evict_all()?;
                    if !self.cache.can_admit(&hit, reserve.min(1)) {
                        return Err(self.too_small(len + output_left));
                    }
                } else {
                    self.waiting.push_front(Waiting {
                        spec: w.spec,
                        tokens: hit.into_tokens(),
                        sampled: w.sampled,
                    });
                    break;
                }
            }
            let req = self.cache.admit(hit)?;
            self.stats.prompt_tokens += req.tokens().len() as u64;
            let (reused, kv_hit) = (req.cached_at_admission(), req.kv_hit_at_admission());
            self.stats.prefix_hit_tokens += reused as u64;
            self.stats.kv_hit_tokens += kv_hit as u64;
            self.stats.recomputed_tokens += kv_hit.saturating_sub(reused) as u64;
            if let Some(mamba) = &mut self.stats.mamba {
                // A model with recurrent state resumes only where a state is cached.
                mamba.recurrent_hit_tokens += reused as u64;
            }
            self.running.push(Running {
                spec: w.spec,
                req,
                sampled: w.sampled,
            });
            self.stats.peak_admitted = self.stats.peak_admitted.max(self.running.len() as u64);
            admitted = true;
            // A match never covers the prompt's last token, so there is always a chunk.
            self.prefill_chunk(self.running.len() - 1, budget)?;
        }
        Ok(admitted)
    }

    /// Prefills the next chunk of `running[i]` within `budget` and caches what it has so
    /// far (the reference engine caches unfinished requests after every chunk, so that
    /// later requests with the same prefix hit it while its SWA is still live). Out of
    /// memory, the newest request is retracted (maybe this one) and the step goes on.
    pub(super) fn prefill_chunk(
        &mut self,
        i: usize,
        budget: &mut usize,
    ) -> Result<bool, ReplayError> {
        loop {
            if i >= self.running.len() {
                return Ok(false); // it was retracted
            }
            let n = self.running[i].req.remaining_prefill().min(*budget);
            match self.cache.alloc_extend(&mut self.running[i].req, n) {
                Ok(()) => {
                    self.computed.push((i, self.running[i].req.id(), n));
                    *budget -= n;
                    self.tokens_done += n as u64;
                    self.cache.cache_unfinished(&mut self.running[i].req)?;
                    if self.running[i].req.remaining_prefill() == 0 {
                        self.first_token(i);
                    }
                    return Ok(true);
                }
                Err(unikv::Error::OutOfMemory { .. }) => {
                    if self.retract_newest()?.is_none() {
                        return Err(self.too_small(self.full_size(i)));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The forward that completes a prefill samples the first output token (a request
    /// re-admitted after retraction already has its pending token).
    pub(super) fn first_token(&mut self, i: usize) {
        let r = &mut self.running[i];
        if r.sampled == 0 {
            r.sampled = 1;
            self.tokens_done += 1;
        }
    }

    /// Runs `alloc` on the requests of `decoders` (ascending indices into `running`) with
    /// output still to go; while memory is short, retracts the newest running request and
    /// retries without it. `Ok(None)`: no request was left to allocate for; else whether
    /// a request was retracted. `extra` is the rows one request needs past its length
    /// (for the error when even one request alone does not fit).
    pub(super) fn alloc_retracting(
        &mut self,
        decoders: &mut Vec<usize>,
        extra: usize,
        mut alloc: impl FnMut(&mut Self, &[usize]) -> Result<(), unikv::Error>,
    ) -> Result<Option<bool>, ReplayError> {
        let mut retracted_any = false;
        loop {
            decoders.retain(|&i| {
                let r = &self.running[i];
                r.sampled < self.workload.requests[r.spec].output_len
            });
            if decoders.is_empty() {
                return Ok(None);
            }
            match alloc(self, decoders) {
                Ok(()) => return Ok(Some(retracted_any)),
                Err(unikv::Error::OutOfMemory { .. }) => {
                    let need = self
                        .full_size(decoders[0])
                        .max(self.running[decoders[0]].req.len() + extra);
                    match self.retract_newest()? {
                        Some(retracted) => {
                            retracted_any = true;
                            decoders.retain(|&i| i != retracted);
                        }
                        None => return Err(self.too_small(need)),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Output tokens a running request has still to decode.
    pub(super) fn output_left(&self, r: &Running) -> usize {
        let len = self.workload.requests[r.spec].output_len;
        (len - r.sampled.min(len)) as usize
    }

    /// The rows the running requests' verifies transiently hold past their settled
    /// ones (each up to the verify width per verify in flight), which admission keeps
    /// free beside the decode estimate (the admitted request's own are priced by
    /// `can_admit`).
    pub(super) fn verify_reserve(&self) -> usize {
        self.spec.as_ref().map_or(0, |s| {
            let held = s.mode.width() as usize * s.mode.speculation().max_in_flight as usize;
            held * self.running.len()
        })
    }

    /// What the running requests keep reserved for their decode.
    pub(super) fn running_reserve(&self) -> usize {
        self.running
            .iter()
            .map(|r| self.estimate.running(self.output_left(r)))
            .sum()
    }

    /// Sends the most recently admitted request back to the front of the queue, its KV
    /// released (the reference engine's retraction), and resets the decode estimate. Returns its index in `running`, or
    /// `None` when it is the only running request (nothing else could make room).
    pub(super) fn retract_newest(&mut self) -> Result<Option<usize>, ReplayError> {
        if self.running.len() < 2 {
            return Ok(None);
        }
        let r = self.running.pop().expect("two or more running");
        let tokens = self.cache.release(r.req)?;
        self.waiting.push_front(Waiting {
            spec: r.spec,
            tokens,
            sampled: r.sampled,
        });
        self.stats.retractions += 1;
        let (decoded, max_new) = self.running.iter().fold((0, 0), |(d, m), r| {
            let len = self.workload.requests[r.spec].output_len;
            (d + u64::from(r.sampled.min(len)), m + u64::from(len))
        });
        self.estimate
            .retracted(decoded, max_new, self.running.len());
        Ok(Some(self.running.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode estimate follows the reference engine's numbers: 0.7 at start, down to
    /// 0.7 x 0.14 after 600 quiet decode steps (never below), reset by a retraction to
    /// what the batch decoded (plus 20 steps each) over what it may decode, at most 1.
    #[test]
    fn the_decode_estimate_decays_and_resets_as_the_reference_engines_does() {
        let mut e = DecodeEstimate::new();
        assert_eq!(DecodeEstimate::admitting(10_000), 4096, "clipped");
        assert_eq!(DecodeEstimate::admitting(100), 100);
        assert_eq!(e.running(1000), 700);
        assert_eq!(e.running(10_000), (4096.0f64 * 0.7).ceil() as usize);
        for _ in 0..300 {
            e.decay();
        }
        assert!((e.ratio - (0.7 + 0.098) / 2.0).abs() < 1e-9, "{e:?}");
        for _ in 0..400 {
            e.decay();
        }
        assert_eq!(e.ratio, DecodeEstimate::MIN);
        assert_eq!(e.running(1000), 98);
        e.retracted(300, 2000, 10);
        assert!((e.ratio - 500.0 / 2001.0).abs() < 1e-12, "{e:?}");
        e.retracted(5000, 2000, 10);
        assert_eq!(e.ratio, 1.0);
    }
}
