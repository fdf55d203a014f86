"""OpenAI's Responses API on the fleet's reply streams (``routes``), kept in Redis (``store``)."""
