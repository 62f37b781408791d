"""Conversations: per-key ownership, paginated listing, message trees with branches, soft delete and purge,
the limits on what a conversation holds, its messages a page at a time, deleting one message, and metadata."""

from __future__ import annotations

import threading
from datetime import timedelta
from itertools import pairwise

import pytest
from sqlalchemy import func, select

from llmserve.errors import InvalidRequestError
from llmserve.platform.conversations import (
    BranchTotals,
    ConversationLimitExceeded,
    ConversationLimits,
    ConversationNotFound,
    ConversationStore,
    MessageNotFound,
    derive_title,
)
from llmserve.store.db import Database
from llmserve.store.schema import ConversationRow, MessageRow, utcnow
from tests.store.fixtures import db_fixture, shared_db_fixture  # noqa: F401

KEY = "key_alice"
OTHER = "key_bob"


@pytest.fixture(name="store")
def store_fixture(db: Database) -> ConversationStore:
    return ConversationStore(db)


def contents(messages) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in messages]


def count(db: Database, row_type: type) -> int:
    with db.session() as session:
        return session.scalar(select(func.count()).select_from(row_type))


def test_create_with_messages_chains_them_and_derives_the_title(store: ConversationStore) -> None:
    created = store.create(KEY, model="tiny-llama", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is   paged\nattention?", "token_count": 7},
        {"role": "assistant", "content": "Blocks.", "token_count": 2},
    ])
    assert created.id.startswith("conv_") and created.key_id == KEY and created.model == "tiny-llama"
    assert created.title == "What is paged attention?"
    system, user, assistant = created.messages
    assert (system.parent_id, user.parent_id, assistant.parent_id) == (None, system.id, user.id)
    assert created.head_message_id == assistant.id
    assert (user.token_count, system.token_count) == (7, None)

    fetched = store.get(KEY, created.id)
    assert fetched == created


def test_a_long_first_message_gives_a_60_character_title() -> None:
    title = derive_title("word " * 40)
    assert len(title) == 60 and title.endswith("…")
    assert derive_title("   ") is None


def test_an_explicit_title_wins_and_an_untitled_conversation_takes_its_first_user_turn(
    store: ConversationStore,
) -> None:
    titled = store.create(KEY, title="  Mine  ", messages=[{"role": "user", "content": "ignored"}])
    assert titled.title == "Mine"
    untitled = store.create(KEY)
    assert (untitled.title, untitled.messages, untitled.head_message_id) == (None, (), None)
    store.append(KEY, untitled.id, "system", "rules")
    assert store.get(KEY, untitled.id).title is None
    store.append(KEY, untitled.id, "user", "hello there")
    assert store.get(KEY, untitled.id).title == "hello there"


def test_append_extends_the_head_and_history_follows_it(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "hi"}])
    reply = store.append(KEY, conversation.id, "assistant", "hello", token_count=1)
    follow_up = store.append(KEY, conversation.id, "user", "how are you?")
    assert reply.parent_id == conversation.head_message_id and follow_up.parent_id == reply.id
    history = store.history(KEY, conversation.id)
    assert contents(history) == [("user", "hi"), ("assistant", "hello"), ("user", "how are you?")]
    after = store.get(KEY, conversation.id)
    assert after.head_message_id == follow_up.id and after.updated_at >= conversation.updated_at


def test_regenerating_a_reply_branches_and_keeps_the_old_one(db: Database, store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "joke?"}])
    question = conversation.messages[0]
    store.append(KEY, conversation.id, "assistant", "first joke")
    store.append(KEY, conversation.id, "user", "another")

    store.append(KEY, conversation.id, "assistant", "second joke", parent_id=question.id)
    assert contents(store.history(KEY, conversation.id)) == [("user", "joke?"), ("assistant", "second joke")]
    assert count(db, MessageRow) == 4  # the first branch is still stored


def test_editing_a_turn_branches_from_its_parent(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[
        {"role": "system", "content": "sys"}, {"role": "user", "content": "typo"},
        {"role": "assistant", "content": "huh?"},
    ])
    system = conversation.messages[0]
    edited = store.append(KEY, conversation.id, "user", "fixed", parent_id=system.id)
    store.append(KEY, conversation.id, "assistant", "answer")
    history = store.history(KEY, conversation.id)
    assert contents(history) == [("system", "sys"), ("user", "fixed"), ("assistant", "answer")]
    assert history[1].id == edited.id


def test_a_parent_from_elsewhere_is_refused(store: ConversationStore) -> None:
    first = store.create(KEY, messages=[{"role": "user", "content": "a"}])
    second = store.create(KEY, messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="is not in conversation"):
        store.append(KEY, second.id, "assistant", "x", parent_id=first.messages[0].id)
    with pytest.raises(ValueError, match="is not in conversation"):
        store.append(KEY, second.id, "assistant", "x", parent_id="msg_unknown")
    assert contents(store.history(KEY, second.id)) == [("user", "b")]


@pytest.mark.parametrize(
    ("role", "content", "token_count", "message"),
    [
        ("robot", "x", None, "role must be one of"),
        ("user", None, None, "content must be a string"),
        ("user", "x", -1, "token_count must be a non-negative integer"),
    ],
)
def test_bad_messages_are_refused(store: ConversationStore, role, content, token_count, message: str) -> None:
    conversation = store.create(KEY)
    with pytest.raises(ValueError, match=message):
        store.append(KEY, conversation.id, role, content, token_count=token_count)
    with pytest.raises(ValueError, match=message):
        store.create(KEY, messages=[{"role": role, "content": content, "token_count": token_count}])


CALL = {"call_id": "call_1", "name": "get_time", "arguments": '{"zone": 3}'}


def test_a_tool_call_and_its_output_are_kept_each_as_a_message(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "Time?"}])
    call, output = store.extend(KEY, conversation.id, [
        {"role": "assistant", "content": "", "tool_call": CALL, "token_count": 9},
        {"role": "tool", "content": "noon", "tool_call_id": "call_1"},
    ])
    assert call.id.startswith("fc_") and output.id.startswith("fco_")
    assert (call.tool_call, call.tool_call_id, output.tool_call, output.tool_call_id) == (CALL, None, None, "call_1")
    assert store.history(KEY, conversation.id)[1:] == [call, output]


@pytest.mark.parametrize(("turn", "message"), [
    ({"role": "user", "content": "", "tool_call": CALL}, "a tool call is an assistant message without content"),
    ({"role": "assistant", "content": "x", "tool_call": CALL}, "a tool call is an assistant message without content"),
    ({"role": "assistant", "content": "", "tool_call": {"call_id": "c", "name": "f"}}, "a tool call has string"),
    ({"role": "assistant", "content": "", "tool_call": {**CALL, "arguments": {}}}, "a tool call has string"),
    ({"role": "assistant", "content": "", "tool_call": {**CALL, "call_id": "c" * 256}}, "a call_id has 1 to 255"),
    ({"role": "tool", "content": "noon"}, "names the call it answers"),
    ({"role": "user", "content": "noon", "tool_call_id": "call_1"}, "names the call it answers"),
    ({"role": "tool", "content": "noon", "tool_call_id": ""}, "a tool_call_id is a string of 1 to 255"),
    ({"role": "user", "content": "x", "reasoning": {"summary": []}}, "reasoning is an assistant message of its own"),
    ({"role": "assistant", "content": "", "tool_call": CALL, "reasoning": {"summary": []}},
     "reasoning is an assistant message of its own"),
    ({"role": "assistant", "content": "x", "reasoning": {"summary": [{"type": "text", "text": "x"}]}},
     "a list of summary_text parts"),
    ({"role": "assistant", "content": "x", "reasoning": {"summary": [], "signature": "x"}},
     "reasoning has a summary and an encrypted_content"),
])
def test_malformed_tool_messages_are_refused(store: ConversationStore, turn: dict, message: str) -> None:
    conversation = store.create(KEY)
    with pytest.raises(ValueError, match=message):
        store.extend(KEY, conversation.id, [turn])
    assert store.history(KEY, conversation.id) == []


def test_reasoning_is_kept_with_its_summary_and_counts_against_the_size_limit(db: Database) -> None:
    store = ConversationStore(db, ConversationLimits(max_message_bytes=16))
    conversation = store.create(KEY)
    summary = [{"type": "summary_text", "text": "sum"}]
    [kept] = store.extend(KEY, conversation.id, [
        {"role": "assistant", "content": "think", "reasoning": {"summary": summary, "encrypted_content": "e" * 8}}])
    assert kept.id.startswith("rs_") and kept.reasoning == {"summary": summary, "encrypted_content": "e" * 8}
    with pytest.raises(ConversationLimitExceeded, match="at most 16 bytes"):
        store.extend(KEY, conversation.id, [
            {"role": "assistant", "content": "think", "reasoning": {"summary": summary, "encrypted_content": "e" * 9}}])


def test_a_tool_calls_name_and_arguments_count_against_the_message_size_limit(db: Database) -> None:
    store = ConversationStore(db, ConversationLimits(max_message_bytes=16))
    conversation = store.create(KEY)
    fits = {"role": "assistant", "content": "", "tool_call": {"call_id": "c", "name": "f", "arguments": "x" * 15}}
    store.extend(KEY, conversation.id, [fits])
    too_large = {**fits, "tool_call": {**fits["tool_call"], "arguments": "x" * 16}}
    with pytest.raises(ConversationLimitExceeded, match="at most 16 bytes"):
        store.extend(KEY, conversation.id, [too_large])


def test_list_pages_newest_first_with_titles_only(store: ConversationStore) -> None:
    ids = [store.create(KEY, messages=[{"role": "user", "content": f"chat {i}"}]).id for i in range(5)]
    store.create(OTHER, title="not mine")

    page1, more1 = store.list(KEY, limit=2)
    page2, more2 = store.list(KEY, limit=2, after=page1[-1].id)
    page3, more3 = store.list(KEY, limit=2, after=page2[-1].id)
    assert [c.id for c in page1 + page2 + page3] == ids[::-1]
    assert (more1, more2, more3) == (True, True, False)
    assert [c.title for c in page1] == ["chat 4", "chat 3"]
    assert all(c.messages == () for c in page1 + page2 + page3)


def test_list_orders_conversations_created_in_the_same_instant_by_id(db: Database, store: ConversationStore) -> None:
    ids = [store.create(KEY).id for _ in range(3)]
    same_instant = utcnow()
    with db.session(write=True) as session:
        for row in session.scalars(select(ConversationRow)):
            row.created_at = same_instant
    page1, _ = store.list(KEY, limit=2)
    page2, more = store.list(KEY, limit=2, after=page1[-1].id)
    assert [c.id for c in page1 + page2] == sorted(ids, reverse=True) and more is False


def test_list_refuses_a_bad_limit_or_cursor(store: ConversationStore) -> None:
    mine = store.create(OTHER)
    for limit in (0, 101):
        with pytest.raises(ValueError, match="limit must be between 1 and 100"):
            store.list(KEY, limit=limit)
    with pytest.raises(ValueError, match="unknown pagination cursor"):
        store.list(KEY, after="conv_nope")
    with pytest.raises(ValueError, match="unknown pagination cursor"):
        store.list(KEY, after=mine.id)  # another key's conversation is no cursor either


def test_another_key_cannot_see_or_touch_a_conversation(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "private"}])
    for key in (OTHER, None):
        with pytest.raises(ConversationNotFound):
            store.get(key, conversation.id)
        with pytest.raises(ConversationNotFound):
            store.history(key, conversation.id)
        with pytest.raises(ConversationNotFound):
            store.append(key, conversation.id, "user", "let me in")
        with pytest.raises(ConversationNotFound):
            store.delete(key, conversation.id)
        assert store.list(key) == ([], False)
    assert contents(store.history(KEY, conversation.id)) == [("user", "private")]


def test_local_mode_sees_only_conversations_made_without_a_key(store: ConversationStore) -> None:
    local = store.create(None, title="local")
    store.create(KEY, title="keyed")
    assert [c.id for c in store.list(None)[0]] == [local.id]
    assert store.get(None, local.id).title == "local"
    with pytest.raises(ConversationNotFound):
        store.get(KEY, local.id)


def test_delete_hides_at_once_but_keeps_the_rows_until_purged(db: Database, store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "bye"}])
    store.delete(KEY, conversation.id)
    with pytest.raises(ConversationNotFound, match=f"conversation '{conversation.id}' not found"):
        store.get(KEY, conversation.id)
    with pytest.raises(ConversationNotFound):
        store.append(KEY, conversation.id, "user", "hello?")
    with pytest.raises(ConversationNotFound):
        store.delete(KEY, conversation.id)
    assert store.list(KEY) == ([], False)
    assert (count(db, ConversationRow), count(db, MessageRow)) == (1, 1)


def test_purge_removes_conversations_deleted_before_the_retention_period(
    db: Database, store: ConversationStore
) -> None:
    old = store.create(KEY, messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    recent = store.create(KEY, messages=[{"role": "user", "content": "c"}])
    kept = store.create(KEY, messages=[{"role": "user", "content": "d"}])
    store.delete(KEY, old.id)
    with db.session(write=True) as session:
        session.get(ConversationRow, old.id).deleted_at = utcnow() - timedelta(days=40)
    store.delete(KEY, recent.id)

    assert store.purge(timedelta(days=30)) == 1
    assert (count(db, ConversationRow), count(db, MessageRow)) == (2, 2)
    assert store.purge(timedelta(days=30)) == 0
    assert store.purge(timedelta(days=30), now=utcnow() + timedelta(days=31)) == 1
    assert [c.id for c in store.list(KEY)[0]] == [kept.id]
    assert (count(db, ConversationRow), count(db, MessageRow)) == (1, 1)


def test_purge_removes_a_conversation_longer_than_sqlites_trigger_depth(db: Database) -> None:
    store = ConversationStore(db, ConversationLimits(max_messages=1500))
    conversation = store.create(KEY).id
    for _ in range(15):
        store.extend(KEY, conversation, user_turns(*["x"] * 100))
    store.delete(KEY, conversation)
    assert store.purge(timedelta(0), now=utcnow() + timedelta(seconds=1)) == 1
    assert count(db, MessageRow) == count(db, ConversationRow) == 0


def test_concurrent_appends_chain_instead_of_forking(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "start"}])
    errors: list[BaseException] = []

    def append_many(writer: int) -> None:
        try:
            for i in range(10):
                store.append(KEY, conversation.id, "user", f"{writer}-{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=append_many, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    history = store.history(KEY, conversation.id)
    assert len(history) == 41
    assert all(later.parent_id == earlier.id for earlier, later in pairwise(history))


def test_as_dict_shapes(store: ConversationStore) -> None:
    conversation = store.create(KEY, model="m", messages=[{"role": "user", "content": "hi", "token_count": 1}])
    data = conversation.as_dict()
    assert data["object"] == "conversation" and data["id"] == conversation.id
    assert isinstance(data["created_at"], int)
    assert data["messages"] == [{
        "id": conversation.messages[0].id, "object": "conversation.message", "parent_id": None, "role": "user",
        "content": "hi", "images": [], "tool_call": None, "tool_call_id": None, "reasoning": None, "token_count": 1,
        "created_at": int(conversation.messages[0].created_at.timestamp()),
    }]
    assert "messages" not in conversation.as_dict(with_messages=False)


# ---- limits ---------------------------------------------------------------------------------------


def small_store(db: Database) -> ConversationStore:
    return ConversationStore(db, ConversationLimits(max_message_bytes=8, max_messages_per_request=3, max_messages=5))


def user_turns(*contents: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content} for content in contents]


def test_the_default_limits_are_one_mebibyte_100_at_once_and_10000_per_conversation() -> None:
    limits = ConversationLimits()
    assert (limits.max_message_bytes, limits.max_messages_per_request, limits.max_messages) == (1 << 20, 100, 10_000)
    limits.check(["x" * (1 << 20)] * 100, existing=9_900)
    with pytest.raises(ConversationLimitExceeded):
        limits.check(["x" * ((1 << 20) + 1)])
    with pytest.raises(ValueError, match="max_messages must be at least 1"):
        ConversationLimits(max_messages=0)


@pytest.mark.parametrize(
    ("contents", "code", "param"),
    [
        (["a", "b", "c", "d"], "too_many_messages", "messages"),
        (["fits", "ééééé"], "message_too_large", "messages[1].content"),  # 5 characters, 10 bytes
    ],
)
def test_create_refuses_too_many_or_too_large_messages_and_stores_nothing(
    db: Database, contents: list[str], code: str, param: str
) -> None:
    store = small_store(db)
    with pytest.raises(ConversationLimitExceeded) as refused:
        store.create(KEY, messages=user_turns(*contents))
    assert (refused.value.code, refused.value.param) == (code, param)
    assert (count(db, ConversationRow), count(db, MessageRow)) == (0, 0)


def test_append_stops_at_the_conversation_limit_counting_every_branch(db: Database) -> None:
    store = small_store(db)
    conversation = store.create(KEY, messages=user_turns("a", "b", "c"))
    store.append(KEY, conversation.id, "assistant", "d")
    store.append(KEY, conversation.id, "assistant", "e", parent_id=conversation.messages[0].id)  # a branch
    with pytest.raises(ConversationLimitExceeded) as refused:
        store.append(KEY, conversation.id, "user", "f")
    assert refused.value.code == "conversation_too_long"
    with pytest.raises(ConversationLimitExceeded, match="at most 8 bytes"):
        store.append(KEY, store.create(KEY).id, "user", "123456789")
    assert store.message_count(KEY, conversation.id) == 5
    assert len(store.history(KEY, conversation.id)) == 2  # the active branch: a, e


def test_concurrent_appends_never_pass_the_conversation_limit(db: Database) -> None:
    store = ConversationStore(db, ConversationLimits(max_messages=21))
    conversation = store.create(KEY, messages=user_turns("start"))
    outcomes: list[str] = []

    def append_many() -> None:
        for _ in range(10):
            try:
                store.append(KEY, conversation.id, "user", "more")
                outcomes.append("stored")
            except ConversationLimitExceeded:
                outcomes.append("refused")

    threads = [threading.Thread(target=append_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (outcomes.count("stored"), outcomes.count("refused")) == (20, 20)
    assert store.message_count(KEY, conversation.id) == 21


# ---- messages, a page at a time -------------------------------------------------------------------


def page_contents(store: ConversationStore, conversation_id: str, **kwargs) -> tuple[list[str], bool]:
    page, has_more = store.messages(KEY, conversation_id, **kwargs)
    return [m.content for m in page], has_more


def test_messages_page_through_the_active_branch_in_either_order(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=user_turns(*"abcde"))
    ids = {m.content: m.id for m in conversation.messages}
    assert page_contents(store, conversation.id, limit=2) == (["e", "d"], True)  # newest first by default
    assert page_contents(store, conversation.id, limit=2, after=ids["d"]) == (["c", "b"], True)
    assert page_contents(store, conversation.id, limit=2, after=ids["b"]) == (["a"], False)
    assert page_contents(store, conversation.id, limit=2, before=ids["b"]) == (["d", "c"], True)
    assert page_contents(store, conversation.id, limit=2, before=ids["d"]) == (["e"], False)
    assert page_contents(store, conversation.id, limit=3, order="asc") == (["a", "b", "c"], True)
    assert page_contents(store, conversation.id, limit=3, order="asc", after=ids["c"]) == (["d", "e"], False)
    assert page_contents(store, conversation.id, limit=2, order="asc", before=ids["e"]) == (["c", "d"], True)
    assert page_contents(store, conversation.id, limit=100, order="asc") == (list("abcde"), False)
    assert page_contents(store, store.create(KEY).id) == ([], False)


def test_messages_follow_the_branch_and_the_summary_counts_it(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=[{"role": "user", "content": "q", "token_count": 3}])
    old = store.append(KEY, conversation.id, "assistant", "old answer", token_count=4)
    store.append(KEY, conversation.id, "assistant", "new answer", token_count=5, parent_id=conversation.messages[0].id)
    assert page_contents(store, conversation.id, order="asc") == (["q", "new answer"], False)
    with pytest.raises(InvalidRequestError, match="unknown pagination cursor") as refused:
        store.messages(KEY, conversation.id, after=old.id)  # on another branch: no cursor here
    assert refused.value.param == "after"
    summary, totals = store.summary(KEY, conversation.id)
    assert (summary.id, summary.messages, totals) == (conversation.id, (), BranchTotals(messages=2, tokens=8))
    assert store.summary(KEY, store.create(KEY).id)[1] == BranchTotals(0, 0)


def test_messages_refuse_bad_cursors_limits_and_orders(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=user_turns("a"))
    elsewhere = store.create(KEY, messages=user_turns("b")).messages[0].id
    empty = store.create(KEY)
    cases = [
        ({"after": "msg_unknown"}, "after"),
        ({"before": elsewhere}, "before"),
        ({"after": conversation.messages[0].id, "before": conversation.messages[0].id}, "before"),
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "sideways"}, "order"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidRequestError) as refused:
            store.messages(KEY, conversation.id, **kwargs)
        assert refused.value.param == param, kwargs
    with pytest.raises(InvalidRequestError, match="unknown pagination cursor"):
        store.messages(KEY, empty.id, before="msg_unknown")
    with pytest.raises(ConversationNotFound):
        store.messages(OTHER, conversation.id)


def test_a_user_message_keeps_its_images_within_the_image_limit(db: Database) -> None:
    """A user message's content parts are kept with it and listed as its images (in both databases); a message
    whose image URLs pass `max_image_bytes` is refused, as are images on another role's message."""
    store = ConversationStore(db, ConversationLimits(max_image_bytes=60))
    conversation = store.create(KEY)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
             {"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
    message = store.append(KEY, conversation.id, "user", "what is it", parts=parts)
    store.append(KEY, conversation.id, "assistant", "a cat")
    stored = store.get(KEY, conversation.id).messages
    assert [m.parts for m in stored] == [parts, None]
    assert [m.as_dict()["images"] for m in stored] == [["data:image/png;base64,AAAA", "https://x/y.png"], []]
    assert store.history(KEY, conversation.id, message.id)[0].images == message.images
    too_many = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 20}}] * 2
    with pytest.raises(ConversationLimitExceeded, match="at most 60 bytes of images") as refused:
        store.append(KEY, conversation.id, "user", "and these", parts=too_many)
    assert refused.value.param == "messages[0].content"
    with pytest.raises(ValueError, match="only user messages hold images"):
        store.append(KEY, conversation.id, "assistant", "x", parts=parts)
    assert store.message_count(KEY, conversation.id) == 2


# ---- deleting one message -------------------------------------------------------------------------


def tree_links(store: ConversationStore, conversation_id: str) -> dict[str, str | None]:
    """Each message's content -> its parent's content, every branch."""
    messages = store.tree(KEY, conversation_id)[1]
    by_id = {m.id: m.content for m in messages}
    return {m.content: by_id.get(m.parent_id) for m in messages}


def test_deleting_a_middle_message_moves_its_children_up_on_every_branch(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=user_turns("a", "b", "c"))
    a, b, _ = conversation.messages
    other_branch = store.append(KEY, conversation.id, "assistant", "c2", parent_id=b.id)  # the head now
    after = store.delete_message(KEY, conversation.id, b.id)
    assert after.head_message_id == other_branch.id and after.updated_at >= conversation.updated_at
    assert tree_links(store, conversation.id) == {"a": None, "c": "a", "c2": "a"}
    assert contents(store.history(KEY, conversation.id)) == [("user", "a"), ("assistant", "c2")]
    assert store.message_count(KEY, conversation.id) == 3
    with pytest.raises(MessageNotFound):
        store.message(KEY, conversation.id, b.id)
    assert store.message(KEY, conversation.id, a.id).content == "a"


def test_deleting_the_head_moves_the_head_to_its_parent(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=user_turns("a", "b", "c"))
    a, b, c = conversation.messages
    assert store.delete_message(KEY, conversation.id, c.id).head_message_id == b.id
    assert contents(store.history(KEY, conversation.id)) == [("user", "a"), ("user", "b")]
    assert store.delete_message(KEY, conversation.id, a.id).head_message_id == b.id  # the root: b becomes one
    assert tree_links(store, conversation.id) == {"b": None}
    assert store.delete_message(KEY, conversation.id, b.id).head_message_id is None
    assert store.history(KEY, conversation.id) == [] and store.message_count(KEY, conversation.id) == 0


def test_deleting_a_message_elsewhere_is_refused_and_deletes_nothing(store: ConversationStore) -> None:
    conversation = store.create(KEY, messages=user_turns("a", "b"))
    elsewhere = store.create(KEY, messages=user_turns("x")).messages[0]
    head = conversation.messages[-1]
    with pytest.raises(ConversationNotFound):
        store.delete_message(OTHER, conversation.id, head.id)
    with pytest.raises(ConversationNotFound):
        store.message(OTHER, conversation.id, head.id)
    for message_id in (elsewhere.id, "msg_unknown"):
        with pytest.raises(MessageNotFound):
            store.delete_message(KEY, conversation.id, message_id)
        with pytest.raises(MessageNotFound):
            store.message(KEY, conversation.id, message_id)
    assert store.get(KEY, conversation.id) == conversation
    assert store.message_count(KEY, elsewhere.conversation_id) == 1


# ---- several messages at once, and metadata -------------------------------------------------------


def test_extend_adds_messages_in_order_after_the_head_all_or_none(db: Database) -> None:
    store = small_store(db)  # 5 messages, 3 at once, 8 bytes each
    conversation = store.create(KEY, messages=[{"role": "system", "content": "sys"}])
    image = [{"type": "image_url", "image_url": {"url": "data:,x"}}, {"type": "text", "text": "what"}]
    added = store.extend(KEY, conversation.id, [
        {"role": "user", "content": "what", "parts": image}, {"role": "assistant", "content": "a cat"},
    ])
    assert [m.parent_id for m in added] == [conversation.head_message_id, added[0].id]
    stored = store.get(KEY, conversation.id)
    assert stored.messages[1:] == tuple(added) and stored.head_message_id == added[-1].id
    assert (stored.title, stored.messages[1].parts, stored.messages[2].parts) == ("what", image, None)
    for too_much in (user_turns("1", "2", "3", "4"), user_turns("1", "2", "3"), user_turns("1", "123456789")):
        with pytest.raises(ConversationLimitExceeded):
            store.extend(KEY, conversation.id, too_much)
    with pytest.raises(ValueError, match="only user messages hold images"):
        store.extend(KEY, conversation.id, [{"role": "assistant", "content": "x", "parts": image}])
    assert store.get(KEY, conversation.id) == stored  # nothing of the refused ones was stored


def test_metadata_round_trips_through_create_and_update(store: ConversationStore) -> None:
    conversation = store.create(KEY, title="Trip", metadata={"topic": "travel", "user": "u1"})
    assert store.get(KEY, conversation.id).metadata == {"topic": "travel", "user": "u1"}
    assert conversation.as_dict(with_messages=False)["metadata"] == {"topic": "travel", "user": "u1"}
    assert store.create(KEY).metadata == {}

    unchanged = store.update(KEY, conversation.id)
    assert (unchanged.title, unchanged.metadata, unchanged.updated_at) == (
        "Trip", {"topic": "travel", "user": "u1"}, conversation.updated_at)
    replaced = store.update(KEY, conversation.id, metadata={"topic": "food"})
    assert (replaced.title, replaced.metadata) == ("Trip", {"topic": "food"})
    assert replaced.updated_at >= conversation.updated_at
    renamed = store.update(KEY, conversation.id, title="Dinner")
    assert (renamed.title, renamed.metadata) == ("Dinner", {"topic": "food"})
    assert store.update(KEY, conversation.id, metadata=None, title=None).metadata == {}
    assert store.list(KEY)[0][-1].metadata == {}

    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        with pytest.raises(ValueError, match="metadata holds at most 16 pairs"):
            store.update(KEY, conversation.id, metadata=bad)
        with pytest.raises(ValueError, match="metadata holds at most 16 pairs"):
            store.create(KEY, metadata=bad)
    with pytest.raises(ConversationNotFound):
        store.update(OTHER, conversation.id, metadata={"mine": "now"})
