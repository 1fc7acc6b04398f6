"""Facts about a kineto trace: what its names mean (`names`), its events as plain records
(`events`), and what they say in figures (`analysis`). Below the advice, which says things
with them, and the profile, which records them."""
