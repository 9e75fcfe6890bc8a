"""The balanced planner: the fewest lock-step steps, about equal modeled cost in every step and on every rank.

How it plans (B = the budget, W = ranks, S = steps, n = sequences):

1. Steps. Packed: S is the lower bound (see ``stats.lower_bound_bins``), more
   only when the micro-batches do not fit in S x W slots: then best-fit
   decreasing says how many are enough. Padded: S is what the fewest padded
   micro-batches (greedy over the globally sorted lengths, which is optimal
   for ``count * longest <= B``) need over W ranks, never more than the
   original dealt greedy. With few micro-batches per rank padded ones are too
   coarse to even out the ranks: when the ranks end more than 0.5% apart,
   other micro-batch counts and then more steps (up to the greedy's) are
   tried, within a bounded amount of work, and the first step count within
   0.5% is kept.
2. Micro-batches, S x W of them (fewer when there are fewer sequences).
   Packed: every sequence longer than B alone, the rest longest-processing-
   time first into the cheapest micro-batch that has room, so they come out
   of about equal cost (best-fit decreasing's own when the fill is too tight
   for that). Both packers work on the histogram of lengths (``_Packer``):
   sequences of one length, and micro-batches holding the same lengths, are
   interchangeable, so a length's sequences go into whole groups of
   micro-batches at once. Padded: contiguous runs of the sorted lengths (that
   keeps padding low), the costliest split until there are S x W, counted
   per distinct length (``_Runs``).
3. Steps from micro-batches: sorted by cost and grouped W at a time, which
   minimises the sum over steps of each step's costliest micro-batch (what a
   lock-step backend waits for) for a given set of micro-batches.
4. Refinement: sequences are moved or swapped out of each step's costliest
   micro-batch when that lowers the sum of step maxima (within the budget),
   and micro-batches regrouped, until nothing improves (bounded work).
5. Ranks: each step's micro-batches are dealt to ranks, costliest to the
   least loaded rank, then swapped within steps (which leaves every step's
   maximum as it is) and sequences moved between ranks into micro-batches
   below their step's maximum, to even out the per-rank totals.
6. Order: the costliest step first, so an out-of-memory shows at once.

``max_seqs`` caps the sequences of every micro-batch in every step above.
Steps 1-3 and 6 take O(n log n) (sorts) plus about O(distinct lengths);
steps 4-5 a fixed budget of candidate evaluations, each round's bookkeeping
counted in it. An evaluation costs O(1) whatever W: every step keeps its
three costliest micro-batches, so what a change does to its maximum is read,
not recomputed, and evaluations run in numpy blocks, in the order (and with
the ties) of a loop over them. Everything is deterministic: ties break on
example indices.

Where each part lives: ``schedules`` (the planner, step 6 and the sequence
order), ``packed`` (steps 1-2 packed: ``_Rooms``, ``_Packer``) and
``completion`` (its exact search, ``_Completion``), ``padded`` (steps 1-2
padded: ``_Runs``, and the step-count search), ``bins`` (the micro-batches
every step works on), ``options`` (what moving or swapping a sequence would
make of two of them, many at once: ``_Table``), ``steps`` (steps 3-4:
``_Grid``) and ``ranks`` (step 5). ``multiple`` is apart from these steps:
padded micro-batches of a multiple of k sequences (fairseq's ``bsz_mult``).
"""

from balance_batch.balanced.padded import fewest_padded_microbatches
from balance_batch.balanced.schedules import balanced_schedules

__all__ = ["balanced_schedules", "fewest_padded_microbatches"]
