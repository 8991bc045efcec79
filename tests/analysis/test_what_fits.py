"""The what-fits models (``optfuse._analysis._what_fits``): a search seeded by another target's
peaks answers exactly, and the deepest decoder a machine's host memory holds is read off the
host bytes, affine in the depth."""

from optfuse._analysis._fit import largest_affine
from optfuse._analysis._what_fits import affine_guesses, host_depth, seeded_largest


def test_a_search_seeded_by_another_targets_peaks_asks_two_sizes_and_answers_exactly():
  # Another target's peaks (200 bytes a size on 200) read at this target's budget.
  guesses, slope = affine_guesses({4: 1_000, 8: 1_800, 16: None}, 2_000, default=(4, 8))
  assert guesses == (9, 10) and slope == 200.0
  asked = []

  def peak(k):
    asked.append(k)
    return 200 * k + 200

  assert seeded_largest(peak, 2_000, {4: 1_000, 8: 1_800}, default=(4, 8)) == 9
  assert asked == [9, 10]
  # Without another target's peaks: the default probes, and the same exact answer.
  assert seeded_largest(peak, 2_000, None, default=(4, 8)) == largest_affine(
      peak, 2_000, 1, (4, 8)) == 9
  assert seeded_largest(lambda k: None, 2_000, None, default=(1, 2)) == 0


def test_the_host_depth_is_read_from_the_affine_host_bytes_up_to_the_device_depth():
  # 200 bytes a layer on 200 where the loops fuse (a 1-layer step has no loop to stream).
  hosts = {1: 900, 4: 1_000, 8: 1_800, 100: 20_200}
  assert host_depth(hosts, 2_000, best=50) == 9
  assert host_depth(hosts, 10**9, best=50) == 50
  assert host_depth(hosts, 100, best=50) == 0
  assert host_depth(hosts, None, best=50) is None
  assert host_depth({4: 1_000, 5: None}, 2_000, best=50) is None
