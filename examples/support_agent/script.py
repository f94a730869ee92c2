"""The scripted model: a stand-in for an LLM, so the example runs with no network and no key.

It decides from the message history only (never from process memory), so a step asked again
gets the same answer, tool call ids included: an effect's message id derives from its call
id. Every request it receives is appended to the file named by ``OUTBOXKIT_AGENT_MODEL_LOG``
(one line: the prompt and the step), which is how the demo shows that a worker resuming a
run never asks the model again for a step that committed.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from examples.support_agent.config import MODEL_LOG

ORDER_ID = re.compile(r"\b[A-Z]-\d+\b")


def prompt_of(messages: list[ModelMessage]) -> str:
    for message in messages:
        for part in getattr(message, "parts", ()):
            if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                return part.content
    return ""


def count_request(prompt: str, step: int) -> None:
    path = os.environ.get(MODEL_LOG)
    if path:
        with open(path, "a") as log:  # closed at once: a SIGKILL right after loses nothing
            log.write(f"{prompt}\tstep {step}\n")


def call(tool: str, step: int, **args: Any) -> ModelResponse:
    # A fixed call id: the same step asked again must name the same call (and message).
    return ModelResponse(parts=[ToolCallPart(tool, args, tool_call_id=f"{tool}-{step}")])


def answer(text: str) -> ModelResponse:
    return ModelResponse(parts=[TextPart(text)])


def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The next model response for *messages*: look the order up, reorder what is out of
    stock, then answer with the supplier's reference."""
    prompt = prompt_of(messages)
    step = 1 + sum(isinstance(m, ModelResponse) for m in messages)
    count_request(prompt, step)
    if step == 1:
        found = ORDER_ID.search(prompt)
        if found is None:
            return answer("Which order is it? Please give me its number (like A-1001).")
        return call("lookup_order", step, order_id=found.group())
    last = messages[-1]
    returned = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(
        last, ModelRequest) else []
    if not returned:
        return answer("Sorry, something went wrong; a colleague will get back to you.")
    return after_tool(returned[-1].tool_name, returned[-1].content, step)


def after_tool(tool: str, result: Any, step: int) -> ModelResponse:
    """What to do with a tool's result (*result*: a lookup, or the supplier's evidence)."""
    if tool == "lookup_order" and isinstance(result, dict) and "item" in result:
        if result["in_stock"]:
            return answer(f"Your order {result['order_id']} is in stock and ships today.")
        return call("reorder", step, order_id=result["order_id"], item=result["item"],
                    qty=result["qty"])
    if tool == "reorder" and isinstance(result, dict) and result.get("status") == "confirmed":
        return answer("It was out of stock, so I reordered it from our supplier (their "
                      f"order {result['reference']}); it ships as soon as it arrives.")
    return answer(f"I could not sort this out ({result}); a colleague will get back to you.")


def scripted_model() -> FunctionModel:
    return FunctionModel(respond, model_name="scripted-support")
