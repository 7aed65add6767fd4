"""Fusing models served by vLLM in a LangChain RAG chain.

Starts two vLLM servers (here on this machine's CPU, with the embedded default models; on a GPU cluster, point
`--servers` at yours, started with e.g. `--tensor-parallel-size 4`), and answers questions over a small corpus with
`AdaFuseLLM(models=["vllm:URL#name", ...])`: the chain is the one of rag_langchain.ipynb, only the models moved.

    python cookbook/served_models_rag.py --vllm-python .venv-vllm/bin/python   # starts and stops its own servers
    python cookbook/served_models_rag.py --servers vllm:http://gpu1:8000/v1#smollm2-135m vllm:http://gpu2:8000/v1#gemma3-270m
"""
from __future__ import annotations

import argparse
import time
from contextlib import ExitStack

from langchain_community.retrievers import BM25Retriever
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough

from adafuse.models import resolve_model
from adafuse.remote import VLLMServer
from adafuse_integrations.langchain import AdaFuseLLM

DOCUMENTS = [
    "Nordlicht Robotics is a company founded in 2011 in the town of Tromsvik.",
    "The founder of Nordlicht Robotics is an engineer named Ingrid Haldorsen.",
    "The best-selling drone of Nordlicht Robotics is called the Selkie.",
    "Nordlicht Robotics opened a second office in the city of Bergen in 2019.",
    "The company mascot of Nordlicht Robotics is a puffin named Pip.",
]
EXAMPLE = "Context:\nThe Selkie drone is yellow.\n\nQuestion: What colour is the Selkie drone?\nAnswer: yellow\n\n"
QUESTIONS = [
    ("In which town was Nordlicht Robotics founded?", "Tromsvik"),
    ("In which city did Nordlicht Robotics open a second office?", "Bergen"),
]


def rag_answers(models: list[str]) -> dict[str, str]:
    """Each question's answer from a BM25 + prompt + fused-LLM chain over the served `models`."""
    retriever = BM25Retriever.from_documents([Document(page_content=d) for d in DOCUMENTS], k=2)
    prompt = PromptTemplate.from_template(EXAMPLE + "Context:\n{context}\n\nQuestion: {question}\nAnswer:")
    llm = AdaFuseLLM(models=models, max_new_tokens=24, stop=["\n"])
    try:
        chain = ({"context": retriever | (lambda docs: "\n".join(d.page_content for d in docs)),
                  "question": RunnablePassthrough()} | prompt | llm | StrOutputParser())
        answers = {}
        for question, expected in QUESTIONS:
            started = time.perf_counter()
            answers[question] = chain.invoke(question).strip()
            print(f"{question}\n  fused: {answers[question]!r}  (expected {expected!r}, {time.perf_counter() - started:.1f} s)")
        return answers
    finally:
        llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--vllm-python", help="interpreter of a virtualenv with vLLM: start servers for the default models")
    source.add_argument("--servers", nargs="+", help="specs of running servers, vllm:http://host:port/v1#served-name")
    args = parser.parse_args()
    with ExitStack() as stack:
        models = args.servers
        if not models:
            servers = [VLLMServer(args.vllm_python, resolve_model(name), name) for name in ("smollm2-135m", "gemma3-270m")]
            for server in servers:  # both warm up side by side
                stack.callback(server.stop)
                server.start()
            models = [server.wait().spec for server in servers]
        answers = rag_answers(models)
    hits = sum(expected in answers[question] for question, expected in QUESTIONS)
    print(f"{hits}/{len(QUESTIONS)} answers contain the expected string")


if __name__ == "__main__":
    main()
