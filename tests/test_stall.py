"""The generators' progress watchdog's rule (async_rlhf/launch/stall.py); what a Generator
reports while its engine hangs is tested in test_actors_generator.py."""

from async_rlhf.launch.stall import StallWatch


def test_a_generator_stalls_only_without_progress_while_it_has_work():
    watch = StallWatch(stall_s=60)
    assert watch.stalled("gen-0", progress=5, sequences=8, updates=0, now=0) == ""
    assert watch.stalled("gen-0", progress=5, sequences=8, updates=0, now=59) == ""
    why = watch.stalled("gen-0", progress=5, sequences=8, updates=0, now=61)
    assert why == ("stalled: no engine step or weight load for 61 s with 8 sequences in its engine and 0 "
                   "weight updates waiting (generator.stall_s=60)")
    assert watch.stalled("gen-1", progress=5, sequences=0, updates=0, now=0) == ""  # no work
    assert watch.stalled("gen-1", progress=5, sequences=0, updates=0, now=1000) == ""
    assert watch.stalled("gen-1", progress=5, sequences=4, updates=0, now=1001) == ""  # work from here on
    assert watch.stalled("gen-1", progress=6, sequences=4, updates=0, now=1100) == ""  # progress: the clock restarts
    assert watch.stalled("gen-1", progress=6, sequences=4, updates=0, now=1161) != ""
    watch.forget("gen-0")  # replaced: its successor starts its own clock
    assert watch.stalled("gen-0", progress=5, sequences=8, updates=0, now=200) == ""
    # an empty engine whose weight load hangs (the update waits; its engine core stopped, say)
    assert watch.stalled("gen-2", progress=3, sequences=0, updates=1, now=0) == ""
    assert watch.stalled("gen-2", progress=3, sequences=0, updates=1, now=61).startswith("stalled")
