"""The contracts every part of kvrelay shares, and nothing else: the block hash, the records that cross
processes (and their protobuf conversion), sampling parameters, the tokenizer, and operating-system helpers.

The bottom layer: it imports no other kvrelay package but the generated protobuf stubs.
"""
