"""ChatProtocol: how a server reads a chat reply (its reasoning, its tool calls) and what it holds
the output to (``response_format``, ``tool_choice``), from its ``--reasoning_parser``,
``--tool_parser`` and the ``LLM``'s guided decoding backend. Both follow where the rendered prompt
leaves the model: inside a reasoning block it opened, after one it closed, or free to open one."""

from __future__ import annotations

from tensorrt_llm._torch.disaggregation.params import RequestType
from tensorrt_llm.llmapi.reasoning_parser import MiniMaxM3ReasoningParser, ReasoningParserFactory
from tensorrt_llm.logger import plain_message
from tensorrt_llm.sampling_params import GuidedDecodingParams
from tensorrt_llm.serve.errors import ServerError
from tensorrt_llm.serve.reply_parsing import ReplyParsing
from tensorrt_llm.serve.structured_output import after_reasoning, constraint_field, tool_guide
from tensorrt_llm.serve.tool_parser import ToolParserFactory

PROMPT_END_TOKENS = 16  # the prompt's last tokens, decoded, tell its reasoning mode


class ChatProtocol:
    def __init__(
        self,
        tokenizer,
        reasoning_parser: str | None = None,
        tool_parser: str | None = None,
        guided_backend: str | None = None,
    ) -> None:
        """Parser names as the server's flags give them (checked here: an unknown one is a
        ``ValueError`` before the model loads)."""
        if reasoning_parser is not None:
            ReasoningParserFactory.create_reasoning_parser(reasoning_parser)  # (a known name)
        if tool_parser is not None:
            ToolParserFactory.create_tool_parser(tool_parser)
        self.tokenizer = tokenizer
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser
        self.guided_backend = guided_backend

    def _prompt_end(self, prompt: list[int] | dict) -> str:
        ids = prompt if isinstance(prompt, list) else prompt["prompt_token_ids"]
        return self.tokenizer.decode(ids[-PROMPT_END_TOKENS:], skip_special_tokens=False)

    def parsing(self, body, prompt: list[int] | dict) -> ReplyParsing:
        """How a chat request's reply is read: its reasoning (from where its rendered
        ``prompt`` leaves the model), its tool calls. A context server without a tool parser
        takes a context-only request with tools all the same: its reply is the first token, and
        the generation server reads the rest."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = ReasoningParserFactory.create_reasoning_parser(
                self.reasoning_parser, prompt=self._prompt_end(prompt)
            )
        disagg = body.disaggregated_params
        context_only = disagg is not None and disagg.request_type is RequestType.CONTEXT_ONLY
        if not body.calls_tools() or (context_only and self.tool_parser is None):
            return ReplyParsing(reasoning)
        if self.tool_parser is None:
            raise ServerError(
                400, "this server reads no tool calls: start it with --tool_parser", param="tools"
            )
        name = self.tool_parser
        return ReplyParsing(
            reasoning, lambda: ToolParserFactory.create_tool_parser(name), body.tools
        )

    def constrains(self, body, chat: bool) -> bool:
        """Whether the request's output is held to a constraint (``guide`` then builds it)."""
        return body.response_guide() is not None or (chat and self._constrains_calls(body))

    def field(self, body, chat: bool) -> str:
        """The request field its constraint came in (what an error about it names)."""
        if chat and self._constrains_calls(body):
            return "tool_choice"
        return constraint_field(body.structured_outputs)

    def guide(self, body, prompt: list[int] | dict, chat: bool) -> GuidedDecodingParams | None:
        """What the output must match (None: anything): ``response_format``, after the
        reasoning block when this server reads reasoning; or the tool-call markup
        ``tool_choice`` requires (and strict tools under ``auto``), made but not compiled
        (``GrammarGate`` has the engine compile it). A 400 names the field that cannot be held
        to."""
        param = self.field(body, chat)
        try:
            return self._guide(body, prompt, chat, param)
        except (ValueError, RuntimeError) as exc:  # (a size past a limit, JSON or a grammar
            # that cannot be read where the constraint is written after the reasoning)
            message = plain_message(exc, "making a constraint")
            raise ServerError(400, f"{param}: {message}", param=param) from None

    def _guide(self, body, prompt, chat: bool, param: str) -> GuidedDecodingParams | None:
        response, calls = body.response_guide(), None
        if param == "tool_choice":
            if self.tool_parser is None:
                raise ServerError(
                    400,
                    "tool_choice needs a server that reads tool calls (--tool_parser)",
                    param=param,
                )
            mode = MiniMaxM3ReasoningParser.mode_of_prompt(self._prompt_end(prompt))
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
            choice = body.tool_choice
            calls = tool_guide(tools, getattr(choice, "model_dump", lambda: choice)(), mode)
            if calls is not None and response is not None:
                raise ServerError(
                    400,
                    "response_format cannot be held to beside tool_choice required, a named "
                    "tool or strict tools",
                    param="response_format",
                )
        if response is not None and chat and self.reasoning_parser is not None:
            parser = ReasoningParserFactory.parsers[self.reasoning_parser]
            response = after_reasoning(
                response, parser, parser.mode_of_prompt(self._prompt_end(prompt))
            )
        guide = calls or response
        if guide is not None and self.guided_backend is None:
            raise ServerError(
                400,
                f"{param} needs guided decoding: start the server with "
                "--guided_decoding_backend xgrammar",
                param=param,
            )
        return guide

    def _constrains_calls(self, body) -> bool:
        """Whether the request's tool calls are held to a grammar: ``required`` or a named
        tool; under ``auto``, strict tools (where the server has guided decoding)."""
        if not body.tools or body.tool_choice == "none":
            return False
        if body.tool_choice not in (None, "auto"):
            return True
        strict = any(tool.function.strict for tool in body.tools)
        return strict and self.guided_backend is not None and self.tool_parser is not None
