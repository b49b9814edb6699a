"""fsm inside a host application: the host's SQLAlchemy engine, the host's transaction. The
order and the turn commit together; an exception in the block rolls back both.

No server needed. ``python host_application.py``
"""

import sqlalchemy as sa

from fsm import parse
from fsm.replay import EXAMPLES_DIR
from fsm.store import ConversationStore, configure_engine

engine = configure_engine(sa.create_engine("sqlite:///app.db"))  # SQLite: required, before use
store = ConversationStore(engine=engine, auto_upgrade=True)  # borrowed: close() never disposes it
orders = sa.Table(  # the host's own table
    "orders",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.Text),
)
orders.create(engine, checkfirst=True)

turn = parse(EXAMPLES_DIR / "parallel_add_multiply.sse").turns[0]
with engine.begin() as conn:  # the host's transaction
    order = conn.execute(orders.insert().values(status="paid")).inserted_primary_key[0]
    chat = store.bind(conn)
    conversation = chat.create_conversation(metadata={"order": order})
    chat.append(conversation, [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}])
    chat.commit_turn(conversation, turn, ["6912", "408"])
# the order and the turn committed together; an exception in the block rolls back both
print(store.history(conversation)[-1]["content"])  # 408
