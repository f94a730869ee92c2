"""The console's live counts: one reader for every open page, none when nobody listens."""

from __future__ import annotations

import asyncio

from console.live import Live


def test_many_listeners_share_one_reader_and_it_stops_when_they_leave() -> None:
    calls: list[int] = []

    def read() -> dict[str, int]:
        calls.append(1)
        return {"n": len(calls)}

    async def listen(live: Live, events: int) -> list[str]:
        got: list[str] = []
        stream = live.stream()
        async for event in stream:
            got.append(event)
            if len(got) == events:
                break
        await stream.aclose()
        return got

    async def go() -> tuple[list[list[str]], int, int]:
        live = Live(read, every=0.05)
        seen = await asyncio.gather(*(listen(live, 3) for _ in range(10)))
        after = len(calls)
        await asyncio.sleep(0.3)
        await live.close()
        return list(seen), after, len(calls)

    seen, after, later = asyncio.run(go())
    assert all(len(events) == 3 for events in seen)
    assert all(event.startswith("id: ") and "event: overview" in event
               for events in seen for event in events)
    assert after <= 5, f"10 listeners of 3 events caused {after} reads (one reader expected)"
    assert later - after <= 1, "the reader went on after every listener left"


def test_a_failed_read_is_an_event_that_says_so_and_reading_goes_on() -> None:
    answers = iter([RuntimeError("down"), {"n": 1}])

    def read() -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def go() -> list[str]:
        live = Live(read, every=0.01)
        got: list[str] = []
        stream = live.stream()
        async for event in stream:
            got.append(event)
            if len(got) == 2:
                break
        await stream.aclose()
        await live.close()
        return got

    first, second = asyncio.run(go())
    assert "did not answer" in first
    assert '"n": 1' in second


def test_ending_the_streams_ends_every_open_page() -> None:
    async def go() -> list[int]:
        live = Live(lambda: {"n": 1}, every=60.0)  # no new read would come for a minute

        async def listen() -> int:
            return len([event async for event in live.stream()])

        tasks = [asyncio.create_task(listen()) for _ in range(3)]
        await asyncio.sleep(0.2)
        live.end_streams()
        done = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        await live.close()
        return list(done)

    assert asyncio.run(go()) == [1, 1, 1]  # the first overview each, then the end
