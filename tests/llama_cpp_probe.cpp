// A small driver of libllama for tests/test_gguf_llama_cpp.py: loads a GGUF file on the CPU and answers
// one request per stdin line, one answer line (or block) per request on stdout.
//
//   L n id_1 .. id_n m   the prompt in one batch with logits at every position, then m greedy steps: prints
//                        "R" + the n_vocab logits after each of the n + m positions, then "G" + the m tokens
//   T hex                tokenize the UTF-8 text (hex-encoded), special tokens not parsed: "I" + the ids
//   D id_1 .. id_n       detokenize, special tokens kept as text: "S" + the text, hex-encoded
//
// Flash attention off, one sequence, a fresh context per L request.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static std::string unhex(const std::string & h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back((char) strtol(h.substr(i, 2).c_str(), nullptr, 16));
    return out;
}

static void print_row(const float * row, int n_vocab) {
    printf("R");
    for (int v = 0; v < n_vocab; ++v) printf(" %.9g", row[v]);
    printf("\n");
}

static int argmax(const float * row, int n_vocab) {
    int best = 0;
    for (int v = 1; v < n_vocab; ++v) if (row[v] > row[best]) best = v;
    return best;
}

static bool run_logits(llama_model * model, int n_vocab, std::istringstream & in) {
    int n, m;
    in >> n;
    std::vector<llama_token> prompt(n);
    for (auto & t : prompt) in >> t;
    in >> m;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + m + 16;
    cp.n_batch = n + m + 16;
    cp.n_ubatch = n + m + 16;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return false; }
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = prompt[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return false; }
    for (int i = 0; i < n; ++i) print_row(llama_get_logits_ith(ctx, i), n_vocab);
    std::vector<llama_token> out;
    llama_token next = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
    for (int s = 0; s < m; ++s) {
        out.push_back(next);
        batch.token[0] = next;
        batch.pos[0] = n + s;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return false; }
        const float * row = llama_get_logits_ith(ctx, 0);
        print_row(row, n_vocab);
        next = argmax(row, n_vocab);
    }
    printf("G");
    for (auto t : out) printf(" %d", t);
    printf("\n");
    llama_batch_free(batch);
    llama_free(ctx);
    return true;
}

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s MODEL.gguf < requests\n", argv[0]); return 2; }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string op;
        in >> op;
        if (op == "L") {
            if (!run_logits(model, n_vocab, in)) return 1;
        } else if (op == "T") {
            std::string h;
            in >> h;
            const std::string text = unhex(h);
            std::vector<llama_token> ids(text.size() + 8);
            const int k = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), false, false);
            if (k < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
            printf("I");
            for (int i = 0; i < k; ++i) printf(" %d", ids[i]);
            printf("\n");
        } else if (op == "D") {
            std::vector<llama_token> ids;
            for (int t; in >> t;) ids.push_back(t);
            std::vector<char> buf(64 + 32 * ids.size());
            const int k = llama_detokenize(vocab, ids.data(), (int) ids.size(), buf.data(), (int) buf.size(), false, false);
            if (k < 0) { fprintf(stderr, "detokenize failed\n"); return 1; }
            printf("S ");
            for (int i = 0; i < k; ++i) printf("%02x", (unsigned char) buf[i]);
            printf("\n");
        } else {
            fprintf(stderr, "unknown request %s\n", op.c_str());
            return 2;
        }
        fflush(stdout);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
