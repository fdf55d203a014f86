"""Structured-output cases shared by the in-process and the through-a-worker tests: ten JSON
schemas with a question each, on SmolLM2's chat template."""

from tokenfleet.core.vocab import render_chat

SHORT = {"type": "string", "maxLength": 24}

SCHEMAS = [
    {"properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}}},
    {"properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 4}}},
    {
        "properties": {
            "address": {
                "type": "object",
                "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            }
        }
    },
    {"properties": {"done": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 999}}},
    {"properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}},
    {
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["name", "qty"],
                    "additionalProperties": False,
                },
            }
        }
    },
    {"properties": {"celsius": {"type": "integer", "minimum": -50, "maximum": 50}}},
    {"properties": {"value": {"anyOf": [SHORT, {"type": "integer", "minimum": 0, "maximum": 9}]}}},
    {"properties": {"kind": {"const": "event"}, "note": {"type": ["string", "null"], "maxLength": 20}}},
]

for schema in SCHEMAS:  # every property required, nothing else allowed: a complete answer each time
    schema.update(type="object", required=list(schema["properties"]), additionalProperties=False)

QUESTIONS = [
    "Describe a person.",
    "How do you feel about rainy days?",
    "Tag this article about football.",
    "Where is the Eiffel Tower?",
    "Is the task finished? How many steps?",
    "Give a product code.",
    "List what to buy for a cake.",
    "How warm is it in Paris today?",
    "Pick a value.",
    "Log an event.",
]


def chat_ids(tokenizer, text):
    return render_chat(tokenizer, [{"role": "user", "content": text + " Answer in JSON."}])
