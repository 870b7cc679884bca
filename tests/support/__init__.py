"""What the tests share, in one place: no test module imports another test module (or conftest.py), only these.

basics              the repository and ../shared, the real tokenizers and engines, the chat tool set, the API
                    keys no recording may hold, sweep sizes, polling (conftest.py's fixtures use them too)
proxy_harness       plain HTTP to a mitmdump, and mitmdump in front of a vLLM-shaped backend
upstream_tap        a recording hop between the proxy and a backend: what crossed the wire
token_exact         the check that every recorded turn is the ids the replica received and generated
chat_agent          the openai-SDK chat agent the integration tests drive (and the openai-python agent script)
anthropic_agent     what an Anthropic Messages agent sends back: its tools, echoes and tool results
responses_agent     what an OpenAI Responses agent sends back: echoed items and function call outputs
gemini_agent        what a Gemini API agent sends: its tools, thinking config, function responses
agent_reads         what an agent API makes of a request body, for the known-request tests
tito_commands       `python -m tito_addon` run over recordings: replay, redrive, any subcommand
recorded_sessions   sessions recorded in process (the turn service over the sglang replica) for the export tests
recorded_run        a run's worth of those sessions, annotated, for the run-selection tests
seed_reference      the reference for the prompt seed vLLM's derender is sent
example_driver      the example rollout driver run as a subprocess beside a regular-mode proxy
transparent_agents  simulated agents that send no session id, and where each of their requests must land
readme_recipes      the README's Getting started recipes, by name
agent_cli_stack     the real agent CLIs' stack: a loopback-only namespace, the pinned CLIs, their configuration
fleet_agents        the load generator for a fleet of proxies
"""
