"""The wire path's cut scope (``exchange.TaskCut``): what the front door relies on from anyio's CancelScope,
on the request's asyncio task: a cut ends the block and only the block, once, from a callback or from the
task itself, and never swallows a cancellation that is not its own."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from capyctl.adapters.http.exchange import TaskCut


def test_a_cut_from_a_callback_ends_the_block_and_only_the_block() -> None:
    async def main() -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        with TaskCut() as cut:
            loop.call_soon(cut.cancel)  # as the client's hang-up arrives: from the loop, not the task
            await asyncio.sleep(10)
            raise AssertionError("not cut")
        await asyncio.sleep(0)  # the task is not cancelled any more
        return cut.cancelled_caught, "went on"

    assert asyncio.run(main()) == (True, "went on")


def test_a_cut_from_the_task_itself_takes_effect_at_its_next_await() -> None:
    async def main() -> tuple[bool, list[str]]:
        steps: list[str] = []
        with TaskCut() as cut:
            cut.cancel()  # as watch() does when the client was already gone
            steps.append("ran on until its next await")
            await asyncio.sleep(10)
            steps.append("not cut")
        await asyncio.sleep(0)
        return cut.cancelled_caught, steps

    assert asyncio.run(main()) == (True, ["ran on until its next await"])


def test_a_cut_from_the_task_that_ends_the_block_without_an_await_leaks_nothing() -> None:
    async def main() -> bool:
        with TaskCut() as cut:
            cut.cancel()
        await asyncio.sleep(0.01)  # after the block: must not be cancelled
        return cut.cancelled_caught

    assert asyncio.run(main()) is False


def test_a_cut_after_the_block_or_a_second_one_does_nothing() -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        with TaskCut() as cut:
            loop.call_soon(cut.cancel)
            loop.call_soon(cut.cancel)
            await asyncio.sleep(10)
        cut.cancel()
        await asyncio.sleep(0.01)
        return cut.cancelled_caught

    assert asyncio.run(main()) is True


def test_another_cancellation_goes_through_the_block() -> None:
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        with TaskCut() as cut:
            loop.call_soon(cut.cancel)
            loop.call_soon(task.cancel)  # the server's shutdown, at the same turn
            await asyncio.sleep(10)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_an_inner_anyio_scope_lets_the_cut_through() -> None:
    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        with TaskCut() as cut:
            with anyio.move_on_after(10) as inner:
                loop.call_soon(cut.cancel)
                await asyncio.sleep(10)
            raise AssertionError("the inner scope swallowed the cut")
        return cut.cancelled_caught, inner.cancelled_caught

    assert asyncio.run(main()) == (True, False)
