"""The engine's use of the draft: after each step, proposals for every request that just produced a token.

A request that decodes next step (its tokens all computed but the newest) gets up to k proposals, fewer
when the end-of-request rule leaves less room (k3.serve.sequence.end_reason: a verify step emits at most
k + 1 tokens, and a request ends by length at max_tokens; the context never binds sooner, since admission
checks prompt + max_tokens against it). Greedy
requests propose the draft's argmax. Sampled ones use the draft's distribution q under their own
temperature, top-k and top-p: a seeded request proposes the race winner argmax q / E with its own noise
for each position (k3.serve.sampling.position_noise; verification then compares race winners), an
unseeded one draws from q with torch's global RNG and keeps q for rejection sampling. The proposals and q
are stored on the Sequence, which the scheduler reads when it plans the proposal row.
"""

import torch

from k3.serve.sampling import position_noise, race, request_probs
from k3.serve.sequence import Sequence
from k3.spec.draft import DraftModel


class Proposer:
    def __init__(self, draft: DraftModel, num_speculative_tokens: int | None = None):
        self.draft = draft.eval()
        self.k = draft.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {self.k!r}")

    def room(self, seq: Sequence) -> int:
        """Proposals seq can use: k, bounded by the tokens it may still produce (Sequence.tokens_left) minus
        the bonus token; none for a request with a grammar. The draft proposes from its unmasked distribution,
        so proposals would break the grammar, and the tokens verification gives after them would need the big model's
        logits masked at every proposal, i.e. the matcher advanced over proposals that may then be rejected,
        which it cannot take back: such requests decode one token a step."""
        if seq.matcher is not None:
            return 0
        return max(0, min(self.k, seq.tokens_left - 1))

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], summaries: list[torch.Tensor]) -> None:
        """seqs: requests that just produced their newest token; summaries: the big model's block summaries
        at the position that produced it, (len(seqs), d) each. Sets each seq's draft_token_ids (and
        draft_probs for sampled requests)."""
        ks = [self.room(seq) for seq in seqs]
        rows = [i for i, k in enumerate(ks) if k > 0]
        for seq in seqs:
            seq.draft_token_ids, seq.draft_probs = [], None
        if not rows:
            return
        device = summaries[0].device
        idx = torch.tensor(rows, device=device)
        live = [seqs[i] for i in rows]
        g0 = self.draft.features([s[idx] for s in summaries])
        tokens = torch.tensor([seq.last_token_id for seq in live], device=device)
        sampled = [i for i, seq in enumerate(live) if not seq.params.greedy]
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in sampled if not live[i].params.coupled}
        at = torch.tensor(sampled, device=device)
        params_S = [live[i].params for i in sampled]

        def choose(logits: torch.Tensor, j: int) -> torch.Tensor:
            out = logits.argmax(dim=-1)
            if sampled:
                q_S = request_probs(logits[at], params_S, torch.float32)
                for r, i in enumerate(sampled):
                    seq = live[i]
                    if seq.params.coupled:  # proposal j is for output position num_output_tokens + j
                        noise = position_noise(seq.params.seed, [seq.num_output_tokens + j], q_S.shape[1], device)
                        out[i] = race(q_S[r : r + 1], noise)[0]
                    else:
                        out[i] = torch.multinomial(q_S[r], 1)[0]
                        q_rows[i].append(q_S[r])
            return out

        proposals = self.draft.propose(tokens, g0, max(ks), choose)
        proposals = proposals.tolist()
        for i, (seq, k) in enumerate(zip(live, [ks[r] for r in rows], strict=True)):
            seq.draft_token_ids = proposals[i][:k]
            seq.draft_probs = torch.stack(q_rows[i][:k]) if i in q_rows else None
