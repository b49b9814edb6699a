"""The stream: the parser (start with test_parser.py: each rule of the spec), the formats, the
SSE framer, limits and hostile input, splits and cuts, the corpus, fsm.parse and fsm.clients."""
