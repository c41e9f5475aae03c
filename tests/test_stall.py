"""The generators' progress watchdog's rule (async_rlhf/launch/stall.py); what a Generator
reports while its engine hangs is tested in test_actors_generator.py."""

from async_rlhf.launch.stall import StallWatch


def test_a_generator_stalls_only_without_steps_while_it_holds_sequences():
    watch = StallWatch(stall_s=60)
    assert watch.stalled("gen-0", steps=5, sequences=8, now=0) == ""
    assert watch.stalled("gen-0", steps=5, sequences=8, now=59) == ""
    why = watch.stalled("gen-0", steps=5, sequences=8, now=61)
    assert why == "stalled: no engine step for 61 s with 8 sequences in its engine (generator.stall_s=60)"
    assert watch.stalled("gen-1", steps=5, sequences=0, now=0) == ""  # an empty engine has no work
    assert watch.stalled("gen-1", steps=5, sequences=0, now=1000) == ""
    assert watch.stalled("gen-1", steps=5, sequences=4, now=1001) == ""  # work from here on
    assert watch.stalled("gen-1", steps=6, sequences=4, now=1100) == ""  # a step: the clock restarts
    assert watch.stalled("gen-1", steps=6, sequences=4, now=1161) != ""
    watch.forget("gen-0")  # replaced: its successor starts its own clock
    assert watch.stalled("gen-0", steps=5, sequences=8, now=200) == ""
