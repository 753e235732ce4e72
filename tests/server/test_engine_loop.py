"""The hand-over of engine outputs to a request's handler, without a server."""

import asyncio
import gc
import weakref

from jaxllm.engine.request import RequestOutput
from jaxllm.server.engine_loop import Submission


def test_a_slow_reader_holds_one_merged_update_per_choice():
    """Outputs arriving while the handler is stuck sending to a slow client are merged as they arrive: the
    submission keeps one output per choice, however many steps ran, and the reader still gets every token in
    order."""
    async def scenario():
        submission = Submission(["a", "b"])
        alive = []
        for step in range(200):
            for request_id in ("a", "b"):
                output = RequestOutput(request_id, [step], f"{step},", finished=step == 199,
                                       token_ids=list(range(step + 1)))
                alive.append(weakref.ref(output))
                submission.put(output)
        del output
        gc.collect()
        held = sum(ref() is not None for ref in alive)
        updates = await submission.next_updates(timeout=1.0)
        return held, updates, submission.unfinished, await submission.next_updates(timeout=0.01)

    held, updates, unfinished, later = asyncio.run(scenario())
    assert held == 2
    assert sorted(updates) == [0, 1]
    assert updates[0].new_token_ids == list(range(200)) and updates[1].new_text == "".join(f"{s}," for s in range(200))
    assert updates[0].finished and not unfinished
    assert later == {}
